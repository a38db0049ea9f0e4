"""Which coordinates an update touches: masks, top-k overlap, checkpoint diffs and run series."""
