"""Where a Fisher job's memory peaks: the main thread's Python stack each time the process's
resident memory reaches a new high (sampled every 10 ms). The profile behind docs/scale.md.

    python benchmarks/peak_stacks.py MODEL_FOLDER [--prompts 4] [--samples 2] [--max-new-tokens 8] [--budget-mb 256] [--estimator sequence]

RSS, not torch's allocator: on CPU that is what the machine runs out of. Prints the last stacks
(the highest peaks) with their MiB above the memory at the start."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from peakmem import rss_mib  # noqa: E402 (after the path it lives on)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--budget-mb", type=int, default=256)
    ap.add_argument("--estimator", default="sequence", help="sequence | token | empirical | batch")
    ap.add_argument("--show", type=int, default=8, help="how many of the highest peaks to print")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("ALLOWED_MODEL_ROOTS", str(Path(args.model).resolve().parent))
    from compute.jobs.fisher import FisherSpec
    from compute.jobs.fisher_run import run

    main_id = threading.main_thread().ident
    peaks: list[tuple[float, list[str]]] = []
    stop = threading.Event()

    def sample() -> None:
        best = 0.0
        while not stop.is_set():
            m = rss_mib()
            if m > best + 20:
                frame = sys._current_frames().get(main_id)
                stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                         for f in traceback.extract_stack(frame)][-7:]
                peaks.append((m, stack))
                best = m
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    spec = FisherSpec(model=args.model, prompts=args.prompts, samples=args.samples, max_new_tokens=args.max_new_tokens,
                      memory_budget_mb=args.budget_mb, estimator=args.estimator)
    start = rss_mib()
    run(spec)
    stop.set()
    for m, stack in peaks[-args.show:]:
        print(f"{m - start:7.0f} MiB above start: " + " <- ".join(reversed(stack)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
