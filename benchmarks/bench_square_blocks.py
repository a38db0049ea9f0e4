"""The per-row square sums of a linear weight (compute.fisher.persample.linear_square_sum), with
and without CPU cache blocking, against one batched weight-gradient product, side by side on
Llama-like shapes (issue 30: where the Fisher's passes spend their time beyond a forward+backward).

    python benchmarks/bench_square_blocks.py   # writes benchmarks/results/bench_square_blocks.json
    python benchmarks/bench_square_blocks.py --sweep-kib 512 2048 4096 8192 --threads 1 2
        # the block size chosen: each size against one batched product, seven interleaved rounds
        # (median), per thread count; writes benchmarks/results/bench_square_blocks_sweep.json
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPES = [(32, 24, 1536, 512), (32, 24, 512, 1536), (16, 24, 8192, 512), (32, 24, 640, 640),
          (8, 16, 1536, 576), (8, 16, 576, 1536), (8, 16, 576, 576),
          (16, 20, 768, 256), (16, 20, 256, 768)]  # (rows, tokens, out, in); the last two: Qwen3-20M's MLP


def _time(f, repeats: int = 5) -> float:
    f()
    t = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - t) / repeats


def sweep(kib: list[int], threads: list[int], rounds: int = 7) -> int:
    """Each block size against one batched weight-gradient product, interleaved rounds."""
    import statistics

    import torch

    from compute.fisher import persample as ps

    out: dict[str, dict[str, dict[str, float]]] = {}
    for n in threads:
        torch.set_num_threads(n)
        out[str(n)] = {}
        for B, T, o, i in SHAPES:
            g = torch.Generator().manual_seed(0)
            x, gr = torch.randn(B, T, i, generator=g), torch.randn(B, T, o, generator=g)
            times: dict[int, list[float]] = {k: [] for k in kib}
            base: list[float] = []
            for _ in range(rounds):
                for k in kib:
                    ps.CPU_BLOCK_BYTES = k << 10
                    times[k].append(_time(lambda x=x, gr=gr: ps.linear_square_sum(x=x, g=gr), repeats=1))
                base.append(_time(lambda x=x, gr=gr, o=o, i=i: gr.reshape(-1, o).T @ x.reshape(-1, i), repeats=1))
            b = statistics.median(base)
            out[str(n)][str((B, T, o, i))] = {f"{k} KiB": round(statistics.median(v) / b, 3) for k, v in times.items()}
            print(n, (B, T, o, i), out[str(n)][str((B, T, o, i))])
        out[str(n)]["sum over shapes"] = {f"{k} KiB": round(sum(r[f"{k} KiB"] for r in out[str(n)].values()), 2)
                                          for k in kib}
    dest = ROOT / "benchmarks" / "results" / "bench_square_blocks_sweep.json"
    dest.write_text(json.dumps({
        "what": "linear_square_sum's time over one batched weight-gradient product, per CPU block size "
                "(median of interleaved rounds), per torch thread count", "threads": out,
        "command": "python benchmarks/bench_square_blocks.py --sweep-kib " + " ".join(map(str, kib))
                   + " --threads " + " ".join(map(str, threads)),
        "cpu": platform.processor() or platform.machine(), "load_avg_after": os.getloadavg()}, indent=1) + "\n")
    print(f"wrote {dest}")
    return 0


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep-kib", type=int, nargs="*", default=None)
    ap.add_argument("--threads", type=int, nargs="*", default=[1])
    a = ap.parse_args()
    if a.sweep_kib:
        return sweep(a.sweep_kib, a.threads)
    import torch

    from compute.fisher import persample as ps

    torch.set_num_threads(1)
    rows = []
    blocked_bytes = ps.CPU_BLOCK_BYTES
    for B, T, o, i in SHAPES:
        g = torch.Generator().manual_seed(0)
        x, gr = torch.randn(B, T, i, generator=g), torch.randn(B, T, o, generator=g)
        ps.CPU_BLOCK_BYTES = 1 << 62  # whole-weight products, one per row
        square = lambda x=x, gr=gr: ps.linear_square_sum(x=x, g=gr)  # noqa: E731
        whole = _time(square)
        ps.CPU_BLOCK_BYTES = blocked_bytes
        blocked = _time(square)
        batched = _time(lambda x=x, gr=gr, o=o, i=i: gr.reshape(-1, o).T @ x.reshape(-1, i))
        rows.append({"shape": [B, T, o, i], "whole_s": whole, "blocked_s": blocked, "batched_grad_s": batched,
                     "whole_over_batched": whole / batched, "blocked_over_batched": blocked / batched})
        print(f"{(B, T, o, i)}: whole {whole / batched:.2f}x, blocked {blocked / batched:.2f}x one batched product")
    out = ROOT / "benchmarks" / "results" / "bench_square_blocks.json"
    out.write_text(json.dumps({"rows": rows, "threads": 1, "block_bytes": blocked_bytes,
                               "command": "python benchmarks/bench_square_blocks.py",
                               "load_avg_after": os.getloadavg()}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
