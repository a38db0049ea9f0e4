"""The Fisher job at researcher scale on a CUDA device (issue 30): device memory per parameter above
the loaded weights, and the job's time against the floor of its workload, up to Qwen3-8B's shape.

    python benchmarks/bench_scale_gpu.py [--sizes qwen3-0.6b,qwen3-1.7b,qwen3-8b] [--dtype bfloat16]

The CPU twin is bench_scale.py (20M-360M). Each size is a random-init model of a real family's
shape (Qwen3: 151,936-token vocabulary, GQA, tied embeddings up to 4B, untied at 8B), built
directly on the device in the job's dtype (no checkpoint is written: 16 GB at 8B) and measured in
a FRESH process:
- device peak: torch.cuda.max_memory_allocated during the job minus what was allocated with the
  weights loaded, over the parameter count (beyond the temporaries budget: minus --budget-mb);
- host peak: the process's RSS high-water mark during the job minus its RSS before it (the sums
  come to the CPU for the statistics: benchmarks/peakmem.py);
- floor: sampling the job's completions plus one batched forward + backward over them, timed
  after the job in the same process (both after one warm-up): ratio = job / floor; "passes / one
  forward+backward" is the per-sample passes alone (the job's seconds_parts).
A half-precision job's float32 error check makes the job's own model float32 in place when what
the job's allowance leaves has room for it (compute.fisher.precision; the result says when not).
A size that fails or runs past --timeout is recorded with its error and the next one runs.
Writes --out (default benchmarks/results/bench_scale_gpu.json) after every size.
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
# name -> (family, hidden, layers, intermediate, heads, kv heads, vocab, tied)
SHAPES = {
    "tiny": ("llama", 64, 2, 128, 4, 2, 49152, True),  # the script's own check on a CPU
    "llama-50m": ("llama", 512, 8, 1536, 8, 4, 49152, True),  # bench_scale.py's 50m
    "qwen3-0.6b": ("qwen3", 1024, 28, 3072, 16, 8, 151936, True),
    "qwen3-1.7b": ("qwen3", 2048, 28, 6144, 16, 8, 151936, True),
    "qwen3-4b": ("qwen3", 2560, 36, 9728, 32, 8, 151936, True),
    "qwen3-8b": ("qwen3", 4096, 36, 12288, 32, 8, 151936, False),
}

CHILD = r"""
import json, os, shutil, sys, time
sys.path.insert(0, os.environ["ROOT"]); sys.path.insert(0, os.path.join(os.environ["ROOT"], "benchmarks"))
import torch
from peakmem import rss_peak_of
fam, H, L, I, A, KV, V, tied = json.loads(os.environ["SHAPE"])
dev, dtype_name = os.environ["DEVICE"], os.environ["DTYPE"]
dtype = getattr(torch, dtype_name)
folder = os.environ["FOLDER"]
os.makedirs(folder, exist_ok=True)
for f in os.listdir(os.environ["TOK"]):
    if f.startswith(("tokenizer", "special_tokens")):
        shutil.copy(os.path.join(os.environ["TOK"], f), folder)
if fam == "qwen3":
    from transformers import Qwen3Config as C, Qwen3ForCausalLM as M
    cfg = C(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=A,
            num_key_value_heads=KV, head_dim=128, tie_word_embeddings=tied, max_position_embeddings=1024)
else:
    from transformers import LlamaConfig as C, LlamaForCausalLM as M
    cfg = C(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=A,
            num_key_value_heads=KV, tie_word_embeddings=tied, max_position_embeddings=1024)
cfg.save_pretrained(folder)
t0 = time.perf_counter()
torch.manual_seed(0)
torch.set_default_dtype(dtype)
with torch.device(dev):
    model = M(cfg)
torch.set_default_dtype(torch.float32)
model.eval()
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(folder)
build_s = time.perf_counter() - t0
from compute.jobs import fisher_run
from compute.jobs.fisher import FisherSpec
from compute.lm.sampling import sample_completions
from compute.lm.verifiable_tasks import get_task
W = json.loads(os.environ["WORKLOAD"])
spec = FisherSpec(model=folder, prompts=W["prompts"], samples=W["samples"], max_new_tokens=W["max_new_tokens"],
                  memory_budget_mb=int(os.environ["BUDGET"]), device=dev, dtype=dtype_name)
n = sum(p.numel() for p in model.parameters())
ex = get_task(spec.task).examples(spec.prompts, seed=spec.seed, split="train", start=0)
cuda = dev.startswith("cuda")
sync = torch.cuda.synchronize if cuda else (lambda: None)
# warm-up (one-time kernel and allocator setup, paid by whichever runs first)
_w = sample_completions(model, tok, [ex[0].prompt], 1, 2, 1.0, None, None, 0, 64)
model(input_ids=_w.input_ids, attention_mask=_w.attention_mask).logits.float().sum().backward()
model.zero_grad(set_to_none=True)
del _w
fisher_run._load = lambda s, r: (model, tok)  # the job's work beyond loading
sync()
if cuda:
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
box = {}
t0 = time.perf_counter()
host = rss_peak_of(lambda: box.setdefault("r", fisher_run.run(spec)))
sync()
t_job = time.perf_counter() - t0
dev_peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
r = box.pop("r")
summary = r.summary
del r
t0 = time.perf_counter()
roll = sample_completions(model, tok, [e.prompt for e in ex], spec.samples, spec.max_new_tokens, 1.0,
                          None, None, spec.seed, 64)
sync()
t_sample = time.perf_counter() - t0
t0 = time.perf_counter()
logits = model(input_ids=roll.input_ids, attention_mask=roll.attention_mask).logits.float()
lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, roll.input_ids[:, 1:, None])[..., 0]
(lp * roll.completion_mask[:, 1:]).sum().backward()
sync()
t_fb = time.perf_counter() - t0
pe = summary.get("precision_error") or {}
print(json.dumps({"n_params": n, "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
                  "device_peak_above_weights_mb": dev_peak, "host_peak_mb": host, "build_s": build_s,
                  "sample_s": t_sample, "forward_backward_s": t_fb, "job_s": t_job, "fisher_s": summary["seconds"],
                  "rows": summary["n_rows"], "tokens": summary["n_tokens"],
                  "seconds_parts": summary.get("seconds_parts"),
                  "split_half_jaccard": summary.get("split_half_jaccard"),
                  "precision_relative_l1": pe.get("relative_l1"),
                  "precision_error_skipped": summary.get("precision_error_skipped"),
"float32_error_check_s": (summary.get("seconds_parts") or {}).get("float32 error check"),
                  "device_name": torch.cuda.get_device_name() if cuda else "cpu",
                  "torch": torch.__version__}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="qwen3-0.6b,qwen3-1.7b,qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budget-mb", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per size")
    ap.add_argument("--tokenizer", default=str(ROOT / "compute" / "zoo_weights" / "arith-base"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_scale_gpu.json"))
    args = ap.parse_args(argv)
    workload = {"prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens}
    rows: list[dict] = []
    t_all = time.time()

    def write() -> None:
        out = {"rows": rows, "budget_mb": args.budget_mb,
               "settings": f"{args.prompts} prompts x {args.samples} samples, {args.max_new_tokens} new tokens, "
                           f"{args.dtype}, {args.device}",
               "meta": {"command": "python benchmarks/bench_scale_gpu.py " + " ".join(argv or sys.argv[1:]),
                        "cpus": os.cpu_count(), "machine": platform.machine(),
                        "wall_seconds": round(time.time() - t_all, 1)}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as scratch:
        for size in args.sizes.split(","):
            env = {**os.environ, "ROOT": str(ROOT), "SHAPE": json.dumps(SHAPES[size]),
                   "FOLDER": str(Path(scratch) / size), "TOK": args.tokenizer, "DEVICE": args.device,
                   "DTYPE": args.dtype, "BUDGET": str(args.budget_mb), "ALLOWED_MODEL_ROOTS": scratch,
                   "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "WORKLOAD": json.dumps(workload)}
            row: dict = {"size": size, "shape": SHAPES[size], "dtype": args.dtype}
            try:
                p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                                   timeout=args.timeout)
                if p.returncode:
                    row["error"] = p.stderr[-2000:]
                else:
                    row.update(json.loads(p.stdout.strip().splitlines()[-1]))
            except subprocess.TimeoutExpired:
                row["error"] = f"ran past --timeout {args.timeout:.0f} s"
            if "error" not in row:
                n, floor = row["n_params"], row["sample_s"] + row["forward_backward_s"]
                passes = (row.get("seconds_parts") or {}).get("per-sample passes", row["fisher_s"])
                if row["device_peak_above_weights_mb"] is not None:
                    row["device_bytes_per_param_above_weights"] = row["device_peak_above_weights_mb"] * 2**20 / n
                    row["device_bytes_per_param_beyond_budget"] = (
                        (row["device_peak_above_weights_mb"] - args.budget_mb) * 2**20 / n)
                row["host_bytes_per_param"] = row["host_peak_mb"] * 2**20 / n
                row.update(floor_s=floor, job_over_floor=row["job_s"] / floor,
                           passes_over_forward_backward=passes / max(row["forward_backward_s"], 1e-9))
                print(f"{size}: {n:,} params, device {row.get('device_bytes_per_param_beyond_budget', float('nan')):.2f}"
                      f" B/param beyond the {args.budget_mb} MiB budget, host {row['host_bytes_per_param']:.2f} B/param,"
                      f" job {row['job_s']:.1f} s = {row['job_over_floor']:.2f}x the floor {floor:.2f} s, passes "
                      f"{row['passes_over_forward_backward']:.2f}x one forward+backward; parts {row['seconds_parts']}",
                      flush=True)
            else:
                print(f"{size}: FAILED {row['error'][-1500:]}", flush=True)
            rows.append(row)
            write()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
