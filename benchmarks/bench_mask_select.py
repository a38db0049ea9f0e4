"""The mask job's selection (compute.sparsity.masks.topk_mask) on a Fisher of model size: peak
memory above the scores and time, in a fresh process per run (issue 30: a whole tensor's int64
keys and their temporaries were about 20 bytes a value of the largest tensor; an 8B model's
embedding is 622M values).

    python benchmarks/bench_mask_select.py [--numel 100000000] [--largest 0.5] [--density 0.01]
        [--root CHECKOUT] [--out FILE]

The scores: one tensor of `largest` x numel values (an embedding) and the rest in 16 equal ones,
log-normal, seed 0. --root runs another checkout's topk_mask (a git worktree of an older commit)
with this environment: run two roots alternately for a side-by-side comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["CODE"]); sys.path.insert(0, os.environ["BENCH"])
import torch
torch.set_num_threads(int(os.environ["THREADS"]))
from peakmem import rss_peak_of
from compute.sparsity.masks import n_keep, topk_mask
n, big = int(os.environ["NUMEL"]), float(os.environ["LARGEST"])
g = torch.Generator().manual_seed(0)
scores = {"model.embed_tokens.weight": (torch.randn(int(n * big), generator=g) * 2).exp()}
rest = n - scores["model.embed_tokens.weight"].numel()
for i in range(16):
    scores[f"model.layers.{i}.mlp.up_proj.weight"] = (torch.randn(rest // 16, generator=g) * 2).exp()
total = sum(t.numel() for t in scores.values())
k = n_keep(float(os.environ["DENSITY"]), total)
box = {}
t0 = time.perf_counter()
peak = rss_peak_of(lambda: box.setdefault("m", topk_mask(scores, k)))
sec = time.perf_counter() - t0
kept = sum(int(m.sum()) for m in box["m"].values())
assert kept == k, (kept, k)
mask_mb = total / 2**20  # the bool mask the call returns
print(json.dumps({"numel": total, "largest": scores["model.embed_tokens.weight"].numel(), "k": k,
                  "peak_above_scores_mb": round(peak, 1), "mask_mb": round(mask_mb, 1),
                  "bytes_per_value_beyond_the_mask": round((peak - mask_mb) * 2**20 / total, 3),
                  "seconds": round(sec, 3)}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--largest", type=float, default=0.5, help="share of the values in one tensor")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose topk_mask runs")
    ap.add_argument("--out", default=None, help="append the row (JSON lines) to this file")
    a = ap.parse_args(argv)
    env = {**os.environ, "CODE": a.root, "BENCH": str(ROOT / "benchmarks"), "NUMEL": str(a.numel),
           "LARGEST": str(a.largest), "DENSITY": str(a.density), "THREADS": str(a.threads)}
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    if p.returncode:
        print(p.stderr[-3000:], file=sys.stderr)
        return p.returncode
    row = {**json.loads(p.stdout.strip().splitlines()[-1]), "root": a.root}
    print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
