"""Masked vs dense training step time, in one run (ratios; absolute times are machine noise).

One step = forward + backward of the SFT loss on a fixed batch of arithmetic prompts/answers,
gradient masking, global-norm clipping and the optimizer step, on the zoo architecture (random
weights; no zoo build needed). Variants, interleaved round-robin so drifting machine load hits
all of them alike; the median step time of each is reported:
  dense-torch   torch.optim.AdamW (foreach) with torch's clip_grad_norm_ (the usual baseline)
  dense-ours    compute.train.MaskedOptimizer without a mask
  masked-D      MaskedOptimizer with a random mask at density D (every tensor partly trainable)

Usage: .venv/bin/python benchmarks/bench_masked.py [--steps 30] [--batch 64] [--threads 2]
Writes benchmarks/results/bench_masked.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--densities", default="0.01,0.1,0.5")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_masked.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from compute.masks import random_mask
    from compute.sampling import build_rollout
    from compute.sft import sft_loss
    from compute.tasks import get_task
    from compute.train import (
        MaskedOptimizer,
        clip_grad_norm,
        mask_gradients,
        prepare_masked_params,
        rollout_logprobs,
    )
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
                lp, _ = rollout_logprobs(model, roll.input_ids, roll.attention_mask)
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
            lp, _ = rollout_logprobs(model, roll.input_ids, roll.attention_mask)
            sft_loss(lp, cm).backward()
            mask_gradients(params)
            clip_grad_norm(params, 1.0)
            opt.step()
        return step

    variants = ["dense-torch", "dense-ours"] + [f"masked-{d}" for d in args.densities.split(",")]
    steps = {v: make(v) for v in variants}
    for v in variants:  # warm-up
        for _ in range(3):
            steps[v]()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.steps):
        for v in variants:
            t = time.perf_counter()
            steps[v]()
            times[v].append(time.perf_counter() - t)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    ref = med["dense-torch"]
    rows = [{"variant": v, "median_ms": 1000 * med[v], "vs_dense_torch": med[v] / ref,
             "vs_dense_ours": med[v] / med["dense-ours"]} for v in variants]
    print(f"{'variant':<14} {'median ms':>10} {'x dense-torch':>14} {'x dense-ours':>13}")
    for r in rows:
        print(f"{r['variant']:<14} {r['median_ms']:>10.2f} {r['vs_dense_torch']:>14.3f} {r['vs_dense_ours']:>13.3f}")
    worst = max(r["vs_dense_torch"] for r in rows if r["variant"].startswith("masked"))
    print(f"worst masked / dense-torch: {worst:.3f} (target <= 1.10)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "rows": rows, "worst_masked_vs_dense_torch": worst, "target": 1.10,
        "settings": {**vars(args), "n_params": sum(p.numel() for p in base.parameters()),
                     "torch": torch.__version__, "machine": platform.machine(),
                     "step": "SFT forward+backward, grad mask, clip, AdamW(wd=0.01)"},
        "unix_time": time.time(),
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
