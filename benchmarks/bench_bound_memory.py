"""GRPO's bound check (compute.studies.bound: first_step_bound then summarize, as the train job
runs it) at growing model size: peak resident memory above the loaded weights and the independent
Fisher, per parameter, each size in a fresh process (issue 30: the check was counted in no
memory estimate; compute.contract.cost.BOUND_BYTES_PER_PARAM is fitted from this).

    python benchmarks/bench_bound_memory.py [--sizes 20m,50m] [--group-shares 0.25] [--out FILE]
    python benchmarks/bench_bound_memory.py --small   # 78k-17M params, vocabularies 64-49k, one
        # group: the part beside the sums below the sizes BOUND_FIXED_MB was fitted at
        # (compute.contract.cost.bound_fixed_bytes); writes results/bench_bound_small.json

Each size a random-init Llama of bench_scale.py's shapes (tied 49,152-token embedding), CPU, the
first GRPO batch of 2 prompts x 4 completions of 8 new tokens (the arithmetic task).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["ROOT"]); sys.path.insert(0, os.path.join(os.environ["ROOT"], "benchmarks"))
import torch
torch.set_num_threads(int(os.environ["THREADS"]))
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from peakmem import rss_peak_of
from compute.lm.verifiable_tasks import get_task
from compute.contract.cost import BOUND_BYTES_PER_PARAM as PER, bound_fixed_bytes, bound_plan
from compute.studies.bound import SLICE, bound_check
import compute.lm.sampling, compute.train.objectives.grpo  # imported before the mark
H, L, I, A, KV = json.loads(os.environ["SHAPE"])
cfg = LlamaConfig(vocab_size=int(os.environ.get("VOCAB", "49152")), hidden_size=H, intermediate_size=I,
                  num_hidden_layers=L, num_attention_heads=A, num_key_value_heads=KV,
                  tie_word_embeddings=True, max_position_embeddings=512)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)
tok = AutoTokenizer.from_pretrained(os.environ["TOK"])
task = get_task("arithmetic")
n = sum(p.numel() for p in model.parameters())
fisher = {k: torch.rand_like(p) for k, p in model.named_parameters()}  # the independent Fisher the job holds
names = [k for k, _ in model.named_parameters()]
sizes = [p.numel() for p in model.parameters()]
# GROUP_SHARE: the room bound_plan is given, as a share of what the whole check's sums need (the
# job's free memory less what it holds); unset: one group of all
share = os.environ.get("GROUP_SHARE")
plan = bound_plan(sizes, None if share is None else float(share) * PER * n + bound_fixed_bytes(n) + 4 * max(sizes),
                  0.0, unit=SLICE)
groups = [[(names[i], lo, hi) for i, lo, hi in g] for g in plan.groups]
out = {}
def check():
    out["summary"] = bound_check(model, tok, task, groups=groups, fisher=fisher, prompts=2, group=4,
                                 max_new_tokens=8)[0]
t0 = time.perf_counter()
peak = rss_peak_of(check)
print(json.dumps({"n_params": n, "groups": len(groups), "largest_group": plan.largest,
                  "peak_above_weights_mb": round(peak, 1),
                  "bytes_per_param": round(peak * 2**20 / n, 1),
                  "beyond_largest_group_mb": round(peak - PER * plan.largest / 2**20, 1),
                  "seconds": round(time.perf_counter() - t0, 2)}))
"""


def measure(shape: tuple, threads: int = 2, vocab: int = 49152, root: Path = ROOT,
            group_share: float | None = None) -> dict:
    env = {**os.environ, "ROOT": str(root), "SHAPE": json.dumps(shape), "THREADS": str(threads),
           "VOCAB": str(vocab), "TOK": str(ROOT / "compute" / "zoo_weights" / "arith-base")}
    if group_share is not None:
        env["GROUP_SHARE"] = str(group_share)
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


# (hidden, layers, intermediate, heads, kv heads), vocabulary: from the zoo's size to bench_scale's 20m
SMALL = [((64, 2, 128, 4, 2), 64), ((128, 4, 384, 4, 2), 1024), ((128, 4, 384, 4, 2), 49152),
         ((256, 6, 768, 4, 2), 1024), ((256, 6, 768, 4, 2), 49152)]


def main(argv: list[str] | None = None) -> int:
    from bench_scale import SHAPES

    from compute.contract.cost import BOUND_BYTES_PER_PARAM as PER

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20m,50m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-shares", default="",
                    help="also measure the check in groups: comma-separated shares of the whole check's sums "
                         "the room holds (bound_plan), e.g. 0.25")
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true", help="the small shapes and vocabularies (SMALL)")
    a = ap.parse_args(argv)
    t0 = time.time()
    rows = []
    if a.small:
        from compute.contract.cost import MIB, bound_fixed_bytes

        for shape, vocab in SMALL:
            row = {"shape": list(shape), "vocab": vocab, **measure(shape, a.threads, vocab=vocab)}
            row["estimate_mb"] = round((PER * row["n_params"] + bound_fixed_bytes(row["n_params"])) / MIB, 1)
            row["estimate_over_peak"] = round(row["estimate_mb"] / row["peak_above_weights_mb"], 2)
            print(f"{shape} vocab {vocab}: {row['n_params']:,} params, peak {row['peak_above_weights_mb']:.0f} MiB "
                  f"({row['beyond_largest_group_mb']:.0f} beyond the sums), estimate {row['estimate_mb']:.0f} MiB "
                  f"= {row['estimate_over_peak']}x", flush=True)
            rows.append(row)
        a.out = a.out or str(ROOT / "benchmarks" / "results" / "bench_bound_small.json")
    a.out = a.out or str(ROOT / "benchmarks" / "results" / "bench_bound_memory.json")
    shares: list[float | None] = [None] + [float(x) for x in a.group_shares.split(",") if x]
    for size in [] if a.small else a.sizes.split(","):
        for share in shares:
            row = {"size": size, "shape": SHAPES[size], "group_share": share,
                   **measure(SHAPES[size], a.threads, group_share=share)}
            print(f"{size}: {row['n_params']:,} params, {row['groups']} group(s) of at most {row['largest_group']:,}, "
                  f"bound check {row['peak_above_weights_mb']:.0f} MiB above the weights = {row['bytes_per_param']} "
                  f"bytes/param, {row['beyond_largest_group_mb']:.0f} MiB beyond {PER:g} bytes x the largest group, "
                  f"{row['seconds']} s", flush=True)
            rows.append(row)
    meta = {"command": "python benchmarks/bench_bound_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "threads": a.threads, "machine": platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_seconds": round(time.time() - t0, 1)}
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
