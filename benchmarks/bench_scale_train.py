"""A masked training step at growing model size (issue 30 items 4 and 6): bytes per parameter
above the loaded weights and seconds per step of a 1% random-mask AdamW SFT job.

    python benchmarks/bench_scale_train.py [--sizes 20m,50m,100m] [--steps 2]
        [--out benchmarks/results/bench_scale_train.json] [--stacks 6]

Each size is the random-init Llama of benchmarks/bench_scale.py (same shapes), built into a scratch
folder with a 1% mask from `select_mask("random", 0.01)` saved next to it, and measured in a FRESH
process: the `train` job's runner (compute.jobs.train_run.train_job) with the weights already
loaded (its model load replaced by the loaded model), algo sft (gold targets), AdamW, 2 steps,
batch 2, `concentration=False`, 4 greedy eval prompts; peak = the process's RSS high-water mark
during the job minus its RSS with the weights and the mask loaded (benchmarks/peakmem.py), over
the parameter count. `--stacks N` also prints the Python stack at the N highest RSS peaks and the highest RSS seen
during each line of _train_job (the profile behind docs/scale.md's breakdown; sampled every 10 ms
like benchmarks/peak_stacks.py).
Seconds per step: the loop's own time (summary.seconds, evaluation excluded) over the steps.
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
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_scale import CHILD_PRELUDE, SHAPES  # noqa: E402

CHILD = CHILD_PRELUDE + r"""
folder = os.environ["FOLDER"]
mask_file = os.path.join(folder, "mask-1pct.safetensors")
if not os.path.exists(os.path.join(folder, "config.json")):
    cfg = LlamaConfig(vocab_size=49152, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                      num_attention_heads=A, num_key_value_heads=KV, tie_word_embeddings=True,
                      max_position_embeddings=512)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    m.save_pretrained(folder)
    import shutil
    for f in os.listdir(os.environ["TOK"]):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(os.environ["TOK"], f), folder)
    from compute.sparsity.masks import save_mask, select_mask
    save_mask(select_mask("random", 0.01, params=m, seed=0), mask_file)
    del m
from compute.jobs import train_run
from compute.jobs.train import TrainSpec
spec = TrainSpec(model=folder, mask=mask_file, algo="sft", optimizer="adamw", steps=int(os.environ["STEPS"]),
                 batch=2, max_new_tokens=8, eval_prompts=4, concentration=False, bound=False)
loaded = train_run._load(spec.model, spec)
n = sum(p.numel() for p in loaded[0].parameters())
for w in loaded[0].parameters():  # resident before the mark: a safetensors load maps the weights
    float(w.detach().sum())      # lazily, and the pages the job touches would count as its own
train_run._load = lambda ref, s: loaded  # the job's own work, weights already loaded
peaks = []
stop = threading.Event()
main_id = threading.main_thread().ident
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
def rss_file():  # the part of the RSS that is file pages (a safetensors file read through mmap)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile"):
                return int(line.split()[1]) / 1024
phases = {}
def sample():
    best = 0.0
    while not stop.is_set():
        m = rss()
        frame = sys._current_frames().get(main_id)
        while frame is not None and frame.f_code.co_name != "_train_job":
            frame = frame.f_back
        if frame is not None:  # the job's phase: the line of _train_job running now
            key = f"train_run.py:{frame.f_lineno}"
            phases[key] = max(phases.get(key, 0.0), m - start)
        if m > best + 8:
            frame = sys._current_frames().get(main_id)
            stack = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                     for f in traceback.extract_stack(frame)][-6:]
            peaks.append((m, [f"(file pages {rss_file() - file0:+.0f} MiB)"] + stack))
            best = m
        time.sleep(0.01)
from compute.runtime.memory import release_freed_memory
release_freed_memory()  # the mark starts from the trimmed state: the job trims at its phases, and
box = {}                # what loading left in the heap would otherwise count as before, not after
start, file0 = rss(), rss_file()
th = threading.Thread(target=sample, daemon=True)
if int(os.environ["STACKS"]):
    th.start()
t0 = time.perf_counter()
peak = rss_peak_of(lambda: box.setdefault("r", train_run.train_job(spec)))
t_job = time.perf_counter() - t0
stop.set()
if th.is_alive():
    th.join()
r = box["r"]
print(json.dumps({"n_params": n, "peak_above_weights_mb": peak, "job_s": t_job,
                  "train_s": r.summary["seconds"], "steps": spec.steps,
                  "trainable_fraction": r.summary["trainable_fraction"],
                  "unchanged_exact": r.summary["update_sparsity"].get("unchanged_exact"),
                  "stacks": [[round(m - start), s] for m, s in peaks[-int(os.environ["STACKS"]):]],
                  "phases": {k: round(v) for k, v in phases.items()}}),
      flush=True)
os._exit(0)  # no interpreter teardown (torch's thread pools): the numbers are out
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20m,50m,100m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stacks", type=int, default=0, help="print the stacks at the N highest peaks")
    ap.add_argument("--label", default="", help="a label stored with the rows (e.g. before / after)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_scale_train.json"))
    ap.add_argument("--tokenizer", default=None, help="folder with a tokenizer (default: the shipped arith-base's)")
    args = ap.parse_args(argv)
    tok = args.tokenizer or str(ROOT / "compute" / "zoo_weights" / "arith-base")
    rows = []
    t_all = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        for size in args.sizes.split(","):
            env = {**os.environ, "ROOT": str(ROOT), "SHAPE": json.dumps(SHAPES[size]),
                   "FOLDER": str(Path(scratch) / size), "TOK": tok, "THREADS": str(args.threads),
                   "STEPS": str(args.steps), "STACKS": str(args.stacks),
                   "ALLOWED_MODEL_ROOTS": scratch, "PYTHONPATH": str(ROOT)}
            p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
            if p.returncode:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(p.stdout.strip().splitlines()[-1])
            stacks, phases = r.pop("stacks"), r.pop("phases")
            if phases:  # kept with the row: the phase breakdown a doc quotes comes from a file
                r["highest_rss_mib_per_line"] = phases
            r.update(size=size, shape=SHAPES[size], label=args.label,
                     bytes_per_param_above_weights=r["peak_above_weights_mb"] * 2**20 / r["n_params"],
                     seconds_per_step=r["train_s"] / r["steps"])
            rows.append(r)
            print(f"{size}: {r['n_params']:,} params, {r['bytes_per_param_above_weights']:.2f} B/param above "
                  f"the weights ({r['peak_above_weights_mb']:.0f} MiB), {r['seconds_per_step']:.1f} s/step, "
                  f"job {r['job_s']:.1f} s", flush=True)
            if phases:
                print("  highest RSS above the start per line of _train_job (MiB): "
                      + ", ".join(f"{k} {v}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])))
            for mib, st in stacks:
                print(f"  {mib:6d} MiB above start: " + " <- ".join(reversed(st)))
    out = {"rows": rows, "settings": "sft (gold), AdamW, 1% random mask, batch 2, 8 new tokens, float32, CPU, "
           "concentration off",
           "meta": {"command": "python benchmarks/bench_scale_train.py " + " ".join(argv or sys.argv[1:]),
                    "threads": args.threads, "cpus": os.cpu_count(), "load_avg_after": os.getloadavg(),
                    "machine": platform.machine(), "wall_seconds": time.time() - t_all}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
