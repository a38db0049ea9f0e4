"""The cost of the precision policy in a series (issue 27): the same bf16 run folder read against
a bf16 base (every pair stored alike: exact equality, the C kernel's Fisher loop) and against the
same base stored in float32 (the base's pairs are cast to bfloat16 first, and the Fisher's share
of those pairs goes through compute.sparsity.series._PointAcc._add_mixed), side by side in one
process, rounds alternating. Reports the ratio mixed / alike of the whole checkpoint_series call
(best of the rounds, and the median), with a Fisher (top-1% support, AUC) and without one.

    .venv/bin/python benchmarks/bench_series_mixed.py                 # 6 layers x 4 x 512^2, 3 checkpoints
    .venv/bin/python benchmarks/bench_series_mixed.py --rounds 1 --no-save
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path(__file__).resolve().parent / "results" / "bench_series_mixed.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from compute.sparsity.series import SeriesConfig, checkpoint_series

    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="bench-series-mixed-"))
    shapes = {f"model.layers.{i}.self_attn.{m}_proj.weight": (args.hidden, args.hidden)
              for i in range(args.layers) for m in ("q", "k", "v", "o")}
    base = {n: torch.randn(s) * 0.02 for n, s in shapes.items()}
    fisher = {n: torch.rand(s) for n, s in shapes.items()}

    def write(folder: Path, sd: dict[str, torch.Tensor]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in sd.items()}, str(folder / "model.safetensors"))

    write(root / "base_float32", base)
    write(root / "base_bfloat16", {n: t.bfloat16() for n, t in base.items()})
    cur = {n: t.clone() for n, t in base.items()}
    for step in range(1, args.checkpoints + 1):  # 5% of the coordinates move by ~1e-3 per step
        for n in cur:
            cur[n] = cur[n] + (torch.rand(cur[n].shape) < 0.05) * 1e-3 * torch.randn(cur[n].shape)
        write(root / "run" / f"checkpoint-{step}", {n: t.bfloat16() for n, t in cur.items()})

    times: dict[str, list[float]] = {}
    headline: dict[str, float] = {}
    for _ in range(args.rounds):
        for with_fisher in (True, False):
            for base_dtype in ("bfloat16", "float32"):
                key = f"{base_dtype}{'_fisher' if with_fisher else ''}"
                t0 = time.perf_counter()
                res = checkpoint_series(root / f"base_{base_dtype}", root / "run",
                                        fisher=fisher if with_fisher else None, config=SeriesConfig())
                times.setdefault(key, []).append(time.perf_counter() - t0)
                headline[key] = res.points[-1]["vs_base"]["global"]["all"]["update_sparsity"]
    out = {
        "params": sum(a * b for a, b in shapes.values()), "checkpoints": args.checkpoints, "rounds": args.rounds,
        "ratio_best": {f: min(times[f"float32{f}"]) / min(times[f"bfloat16{f}"]) for f in ("_fisher", "")},
        "ratio_median": {f: statistics.median(times[f"float32{f}"]) / statistics.median(times[f"bfloat16{f}"])
                         for f in ("_fisher", "")},
        "headline_update_sparsity": headline,
        "command": "python benchmarks/bench_series_mixed.py " + " ".join(sys.argv[1:]),
    }
    # the policy's point: the same numbers whichever way the base is stored
    assert abs(headline["float32_fisher"] - headline["bfloat16_fisher"]) < 1e-12, headline
    print(json.dumps(out, indent=1))
    if not args.no_save:
        OUT.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
