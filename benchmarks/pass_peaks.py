"""Memory pass by pass in a Fisher job: before each of the engine's passes the process's RSS, and
during it the RSS high-water mark, both above the RSS once the weights are resident, with the
accumulators' size. The measurement behind ROW_BUDGET_SHARE and FISHER_HELD_SHARE
(compute/contract/cost.py, docs/scale.md).

    python benchmarks/pass_peaks.py MODEL_FOLDER [--prompts 64] [--samples 4] [--max-new-tokens 16] [--budget-mb 1024]

One thread; the job's runner with the model already loaded (as benchmarks/bench_scale.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budget-mb", type=int, default=1024)
    ap.add_argument("--estimator", default="sequence", help="sequence | token | empirical")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    os.environ.setdefault("ALLOWED_MODEL_ROOTS", str(Path(args.model).resolve().parent))
    import torch

    torch.set_num_threads(1)
    from peakmem import _status_kib

    from compute.fisher import estimators as engine
    from compute.jobs import fisher_run
    from compute.jobs.fisher import FisherSpec

    spec = FisherSpec(model=args.model, prompts=args.prompts, samples=args.samples,
                      max_new_tokens=args.max_new_tokens, memory_budget_mb=args.budget_mb,
                      estimator=args.estimator)
    model, tok = fisher_run._load(spec, None)
    for p in model.parameters():  # resident before the mark
        float(p.detach().sum())
    fisher_run._load = lambda s, r: (model, tok)

    def mib(key: str) -> float:
        return _status_kib(key) / 1024

    def reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    base = mib("VmRSS")
    one_pass = engine._one_pass

    def measured(model_, store, params, chunk, budget, coverage):  # noqa: ANN001 - the engine's own
        before = mib("VmRSS")
        reset()
        one_pass(model_, store, params, chunk, budget, coverage)
        acc = sum(t.numel() * t.element_size() for d in (store.sums, store.frac) for t in d.values())
        print(f"pass: {chunk[0].shape[0]} rows x {chunk[0].shape[1]} tokens; RSS before {before - base:.0f} MiB, "
              f"high-water during {mib('VmHWM') - base:.0f} MiB, accumulators {acc / 2**20:.0f} MiB", flush=True)

    engine._one_pass = measured
    fisher_run.run(spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
