"""The Fisher job at growing model size (issue 30): bytes per parameter above the loaded weights,
and the job's time against the floor of its workload, side by side in one run.

    python benchmarks/bench_scale.py [--sizes 20m,50m,100m] [--out benchmarks/results/bench_scale.json]

Each size is a random-init Llama of a real family's shape (tied 49,152-token embeddings, GQA),
built into a scratch folder and measured in a FRESH process (so no allocator state carries over):
- peak: the process's RSS high-water mark during the job minus its RSS with the weights loaded
  (/proc/self/clear_refs, benchmarks/peakmem.py), over the parameter count;
- floor: sampling the job's completions plus one batched forward + backward over them (what any
  Fisher of those samples must do at least), timed in the same process after the job itself
  (`fisherlens fisher`'s runner with the model already loaded; both after one warm-up call):
  ratio = job / floor.
The job runs with the same settings at every size: by default 4 prompts x 2 samples, 8 new tokens
(--prompts, --samples, --max-new-tokens), a 256 MiB temporaries budget (--budget-mb), float32,
CPU, torch threads as given (--threads, default 2). "Fisher / one forward+backward" is the
per-sample passes alone (the job's `seconds_parts`: not sampling, the one-time self-check or the
statistics) against one batched forward + backward over the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # name -> (hidden, layers, intermediate, heads, kv heads)
    "20m": (256, 6, 768, 4, 2),
    "50m": (512, 8, 1536, 8, 4),
    "100m": (640, 16, 1792, 10, 5),
    "200m": (896, 20, 2432, 14, 7),
    "360m": (960, 32, 2560, 15, 5),  # SmolLM2-360M's shape
}
BUDGET_MB = 256

# The first lines of every fresh-process child of the scale benchmarks (bench_scale, bench_scale_train,
# bench_logits): imports, torch threads, the RSS peak helper, the Llama shape from SHAPE.
CHILD_PRELUDE = r"""
import json, os, sys, threading, time, traceback
sys.path.insert(0, os.environ["ROOT"]); sys.path.insert(0, os.path.join(os.environ["ROOT"], "benchmarks"))
import torch
torch.set_num_threads(int(os.environ["THREADS"]))
from transformers import LlamaConfig, LlamaForCausalLM
from peakmem import rss_peak_of
H, L, I, A, KV = json.loads(os.environ["SHAPE"])
"""

CHILD = CHILD_PRELUDE + r"""
folder = os.environ["FOLDER"]
if not os.path.exists(os.path.join(folder, "config.json")):
    cfg = LlamaConfig(vocab_size=49152, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                      num_attention_heads=A, num_key_value_heads=KV, tie_word_embeddings=True,
                      max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    import shutil
    for f in os.listdir(os.environ["TOK"]):
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(os.environ["TOK"], f), folder)
from compute.jobs import fisher_run
from compute.jobs.fisher import FisherSpec
from compute.lm.sampling import sample_completions
from compute.lm.verifiable_tasks import get_task
W = json.loads(os.environ["WORKLOAD"])
spec = FisherSpec(model=folder, prompts=W["prompts"], samples=W["samples"], max_new_tokens=W["max_new_tokens"],
                  memory_budget_mb=int(os.environ["BUDGET"]), estimator=W.get("estimator", "sequence"))
model, tok = fisher_run._load(spec, None)
n = sum(p.numel() for p in model.parameters())
ex = get_task(spec.task).examples(spec.prompts, seed=spec.seed, split="train", start=0)
# warm-up (one-time kernel and allocator setup, paid by whichever runs first)
_w = sample_completions(model, tok, [ex[0].prompt], 1, 2, 1.0, None, None, 0, 64)
model(input_ids=_w.input_ids, attention_mask=_w.attention_mask).logits.float().sum().backward()
model.zero_grad(set_to_none=True)
del _w
fisher_run._load = lambda s, r: (model, tok)  # the job's work beyond loading
# the job first, so its peak is measured from a process that has not yet held the floor's
# activations (freed heap memory stays resident and would hide the job's own)
box = {}
t0 = time.perf_counter()
peak = rss_peak_of(lambda: box.setdefault("r", fisher_run.run(spec)))
t_job = time.perf_counter() - t0
# the floor: the same number of completions, then one batched forward + backward over them
t0 = time.perf_counter()
roll = sample_completions(model, tok, [e.prompt for e in ex], spec.samples, spec.max_new_tokens, 1.0,
                          None, None, spec.seed, 64)
t_sample = time.perf_counter() - t0
t0 = time.perf_counter()
logits = model(input_ids=roll.input_ids, attention_mask=roll.attention_mask).logits.float()
lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, roll.input_ids[:, 1:, None])[..., 0]
(lp * roll.completion_mask[:, 1:]).sum().backward()
t_fb = time.perf_counter() - t0
model.zero_grad(set_to_none=True)
del logits, lp
r = box["r"]
print(json.dumps({"n_params": n, "peak_above_weights_mb": peak, "sample_s": t_sample,
                  "forward_backward_s": t_fb, "job_s": t_job, "fisher_s": r.summary["seconds"],
                  "rows": r.summary["n_rows"], "tokens": r.summary["n_tokens"],
                  "seconds_parts": r.summary.get("seconds_parts")}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20m,50m,100m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_scale.json"))
    ap.add_argument("--tokenizer", default=None, help="folder with a tokenizer (default: the zoo's)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--budget-mb", type=int, default=BUDGET_MB)
    ap.add_argument("--estimators", default="sequence",
                    help="comma-separated: each size is measured with each (sequence, token, empirical, batch)")
    args = ap.parse_args(argv)
    workload = {"prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens}
    budget_mb = args.budget_mb
    from compute.contract.settings import Settings

    tok = args.tokenizer or str(Path(Settings().zoo_dir).expanduser() / "arith-base")
    rows = []
    t_all = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        for size, estimator in ((s, e) for s in args.sizes.split(",") for e in args.estimators.split(",")):
            env = {**os.environ, "ROOT": str(ROOT), "SHAPE": json.dumps(SHAPES[size]),
                   "FOLDER": str(Path(scratch) / size), "TOK": tok, "THREADS": str(args.threads),
                   "BUDGET": str(budget_mb), "ALLOWED_MODEL_ROOTS": scratch, "PYTHONPATH": str(ROOT),
                   "WORKLOAD": json.dumps({**workload, "estimator": estimator})}
            p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
            if p.returncode:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(p.stdout.strip().splitlines()[-1])
            floor = r["sample_s"] + r["forward_backward_s"]
            passes = (r.get("seconds_parts") or {}).get("per-sample passes", r["fisher_s"])
            r.update(size=size, shape=SHAPES[size], estimator=estimator,
                     bytes_per_param_above_weights=r["peak_above_weights_mb"] * 2**20 / r["n_params"],
                     bytes_per_param_beyond_budget=(r["peak_above_weights_mb"] - budget_mb) * 2**20 / r["n_params"],
                     floor_s=floor, job_over_floor=r["job_s"] / floor,
                     # the Fisher itself: the per-sample passes (not sampling, the one-time
                     # self-check or the statistics) against one batched forward + backward
                     fisher_over_forward_backward=passes / max(r["forward_backward_s"], 1e-9))
            rows.append(r)
            print(f"{size} {estimator}: {r['n_params']:,} params, {r['bytes_per_param_above_weights']:.1f} B/param above the "
                  f"weights ({r['bytes_per_param_beyond_budget']:.1f} beyond the {budget_mb} MiB budget), "
                  f"job {r['job_s']:.1f} s = {r['job_over_floor']:.2f}x the floor {floor:.1f} s", flush=True)
    load = os.getloadavg()
    out = {"rows": rows, "budget_mb": budget_mb,
           "settings": f"{args.prompts} prompts x {args.samples} samples, {args.max_new_tokens} new tokens, "
                       "float32, CPU",
           "meta": {"command": "python benchmarks/bench_scale.py " + " ".join(argv or sys.argv[1:]),
                    "threads": args.threads, "cpus": os.cpu_count(), "load_avg_after": load,
                    "machine": platform.machine(), "wall_seconds": time.time() - t_all}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
