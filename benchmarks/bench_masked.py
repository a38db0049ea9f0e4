"""Masked vs dense training step time, in one run (ratios; absolute times are machine noise).

One step = forward + backward of the SFT loss on a fixed batch of arithmetic prompts/answers,
gradient masking, global-norm clipping and the optimizer step, on the zoo architecture (random
weights; no zoo build needed). Variants, interleaved round-robin so drifting machine load hits
all of them alike; the median step time of each is reported:
  dense-torch   torch.optim.AdamW (foreach) with torch's clip_grad_norm_ (the usual baseline)
  dense-ours    compute.train.MaskedOptimizer without a mask
  masked-D      MaskedOptimizer with a random mask at density D (every tensor partly trainable)

Each round runs one step of every variant, in an order rotated every round. Reported: the median
step time with quartiles, and the median (with quartiles) of the per-round ratio to dense-torch.
Peak memory: RSS high-water mark (VmHWM, reset first) of a fresh child process while it builds the
variant (model copy, mask, optimizer) and runs 3 steps, minus its RSS before (benchmarks/peakmem.py).

Usage: .venv/bin/python benchmarks/bench_masked.py [--steps 30] [--batch 64] [--threads 2]
Writes benchmarks/results/bench_masked.json; `python benchmarks/tables.py` makes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs),
            "max": max(xs), "n": len(xs)}


def child_peak(variant: str, args: argparse.Namespace) -> float:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--batch",
           str(args.batch), "--threads", str(args.threads), "--densities", args.densities]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--densities", default="0.01,0.1,0.5")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_masked.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from compute.lm.sampling import build_rollout, token_logprobs
    from compute.lm.verifiable_tasks import get_task
    from compute.sparsity.masks import random_mask
    from compute.train import (
        MaskedOptimizer,
        clip_grad_norm,
        mask_gradients,
        prepare_masked_params,
    )
    from compute.train.objectives.sft import sft_loss
    from compute.zoo import ZooRecipe, build_model, build_tokenizer

    tok = build_tokenizer()
    base = build_model(tok, ZooRecipe(), seed=0)
    ex = get_task("arithmetic").examples(args.batch, seed=0)
    roll = build_rollout(tok, [e.prompt for e in ex], [e.answer for e in ex])
    cm = roll.completion_mask[:, 1:]

    def make(variant: str):
        import copy

        model = copy.deepcopy(base).train()
        if variant == "dense-torch":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                lp = token_logprobs(model, roll.input_ids, roll.attention_mask)[:, 1:]
                sft_loss(lp, cm).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            return step
        mask = None
        if variant.startswith("masked-"):
            d = float(variant.split("-", 1)[1])
            shapes = {n: p.shape for n, p in model.named_parameters()}
            mask = random_mask(shapes, d, seed=0)
        params = prepare_masked_params(model, mask)
        opt = MaskedOptimizer(params, "adamw", lr=1e-4, weight_decay=0.01)

        def step() -> None:
            opt.zero_grad()
            lp = token_logprobs(model, roll.input_ids, roll.attention_mask)[:, 1:]
            sft_loss(lp, cm).backward()
            mask_gradients(params)
            clip_grad_norm(params, 1.0)
            opt.step()
        return step

    variants = ["dense-torch", "dense-ours"] + [f"masked-{d}" for d in args.densities.split(",")]
    if args.child:  # memory: build one variant and run 3 steps (optimizer state included)
        from peakmem import rss_peak_of

        def build_and_step() -> None:
            step = make(args.child)
            for _ in range(3):
                step()

        print(json.dumps({"peak_mb": rss_peak_of(build_and_step)}))
        return
    t0 = time.time()
    steps = {v: make(v) for v in variants}
    for v in variants:  # warm-up
        for _ in range(3):
            steps[v]()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.steps):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            t = time.perf_counter()
            steps[v]()
            times[v].append(time.perf_counter() - t)
    rows = []
    for v in variants:
        ratios = [t / d for t, d in zip(times[v], times["dense-torch"], strict=True)]
        rows.append({"variant": v, "ms": quartiles([1000 * t for t in times[v]]),
                     "x_dense_torch": quartiles(ratios),
                     "peak_mb": child_peak(v, args)})
    print(f"{'variant':<14} {'median ms':>10} {'x dense-torch (median of rounds)':>34} {'peak MB':>8}")
    for r in rows:
        x = r["x_dense_torch"]
        print(f"{r['variant']:<14} {r['ms']['median']:>10.2f} {x['median']:>12.3f} "
              f"[{x['q1']:.3f}, {x['q3']:.3f}] {r['peak_mb']:>14.1f}")
    worst = max(r["x_dense_torch"]["median"] for r in rows if r["variant"].startswith("masked"))
    print(f"worst masked / dense-torch (median of per-round ratios): {worst:.3f} (target <= 1.10)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "rows": rows, "worst_masked_vs_dense_torch": worst, "target": 1.10,
        "times_ms": {v: [1000 * t for t in ts] for v, ts in times.items()},
        "meta": {"command": "python benchmarks/bench_masked.py " + " ".join(sys.argv[1:]),
                 "git_commit": commit, "torch": torch.__version__,
                 "machine": platform.machine(), "cpu_count": os.cpu_count(),
                 "threads": args.threads, "load_average_at_end": os.getloadavg(),
                 "wall_seconds": round(time.time() - t0, 1),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "n_params": sum(p.numel() for p in base.parameters()),
                 "step": "SFT forward+backward, grad mask, clip, AdamW(wd=0.01)",
                 "args": {k: v for k, v in vars(args).items() if k != "child"}},
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
