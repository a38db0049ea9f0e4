"""What a result shows, drawn once: figures (Plotly), tables and the key numbers.

- `registry.py`: each job kind registers its named figures and tables once; `figures_for(result)`
  and `tables_for(result)` are what the share page, the UI, the CLI's HTML report and the
  downloads call. Builders take the typed result of compute/contract/results.py.
- `fisher.py`, `mask.py`, `train.py`, `sweep.py`, `retention.py`, `diff.py`, `tokens.py`: one
  module per job kind; `tables.py`: the tables every kind shows (overlap, summary, stats CSV).
- `common.py`: shared Plotly helpers (formatting, pooling, layout, stored heatmap, curves);
  `layers.py`: layer x module figures (the aggregation is compute.lm.cells.aggregate).
- `store.py`: build the payload once per job and keep it as one JSON file in the artifact store.
- `keynumbers.py`: the few numbers a researcher came for, per job kind.
- `labels.py`: display names for the rows outside the transformer blocks ("embeddings",
  "final norm", "lm_head" instead of the "-" the compute side stores).

No torch, no Gradio here. app/plots.py is a facade over this package for older callers.
"""
