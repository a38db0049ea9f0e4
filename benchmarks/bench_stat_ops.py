"""What the Fisher statistics cost per value on this machine (issue 30): each full-size operation
they are made of, timed on a million float32 values, and the whole statistics path (split-half
overlap, the Fisher from the sums, histogram, concentration, per-tensor tables) on a synthetic
log-normal Fisher, per million values. One process, torch threads as given.

    python benchmarks/bench_stat_ops.py [--numel 20000000] [--threads 2] [--out benchmarks/results/bench_stat_ops.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def per_call_ms(fn, reps: int = 40) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return round((time.perf_counter() - t0) / reps * 1e3, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=20_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_stat_ops.json"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from compute.fisher import statistics as S
    from compute.fisher.accumulate import HalfSums
    from compute.jobs.fisher_run import divide, topk_jaccard_of_halves

    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1 << 20, generator=g) * 2).exp() * 1e-6
    k = x.view(torch.int32)
    hi = (k >> 16).add_(1 << 15)
    few = k > int(k.kthvalue(int(0.99 * k.numel())).values)  # 1% true
    nb = 1 << 16
    z = torch.zeros(nb, dtype=torch.int32)
    ops = {
        "copy (x + 0.0)": per_call_ms(lambda: x + 0.0),
        "min": per_call_ms(lambda: x.min()),
        "compare (int32 > scalar)": per_call_ms(lambda: k > 5),
        "shift (int32 >> 16)": per_call_ms(lambda: k >> 16),
        "int32 -> int64": per_call_ms(lambda: hi.long()),
        "nonzero (1% true)": per_call_ms(lambda: few.nonzero()),
        "masked select (1% true)": per_call_ms(lambda: k[few]),
        "bincount (65,536 bins)": per_call_ms(lambda: torch.bincount(hi, minlength=nb)),
        "bincount weighted (float64)": per_call_ms(lambda: torch.bincount(hi, weights=x.double(), minlength=nb)),
        "scatter_reduce amin": per_call_ms(lambda: z.scatter_reduce_(0, hi, k, "amin")),
        "float64 sum": per_call_ms(lambda: torch.sum(x, dtype=torch.float64)),
    }
    n = a.numel // 20 * 20
    total, diff = {}, {}
    for i in range(20):
        t = (torch.randn(n // 20, generator=g) * 2).exp() * 1e-6
        total[f"model.layers.{i}.mlp.up_proj.weight"] = t
        diff[f"model.layers.{i}.mlp.up_proj.weight"] = ((torch.rand(n // 20, generator=g) * 2 - 1) * 20000).round().to(torch.int16)
    halves = HalfSums(total, diff, 1)
    parts: dict[str, float] = {}
    t0 = time.perf_counter()
    topk_jaccard_of_halves(halves, 1.0)
    parts["split-half overlap"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fisher = {name: divide(t, 3.0) for name, t in total.items()}
    parts["the Fisher from the sums"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hist = S.ValueHistogram.of(fisher)
    parts["histogram"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    S.to_series(fisher, hist=hist)
    parts["concentration (cut bins)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = S.tensor_stats(fisher)
    S.summary(fisher, hist=hist, rows=rows)
    S.to_layer_stats(fisher, rows)
    S.to_heatmaps(fisher, rows=rows)
    parts["per-tensor tables"] = time.perf_counter() - t0
    per_million = {p: round(v / n * 1e6 * 1e3, 2) for p, v in parts.items()}
    out = {"meta": {"command": "python benchmarks/bench_stat_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "threads": a.threads, "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
           "op_ms_per_million_values": ops, "statistics_numel": n,
           "statistics_ms_per_million_values": per_million,
           "statistics_total_ms_per_million_values": round(sum(per_million.values()), 2)}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
