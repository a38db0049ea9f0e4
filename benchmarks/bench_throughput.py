"""Throughput of this machine in the cost unit of app/limits.py (parameter-token-passes per
second), measured on real jobs, for the per-job time ceiling (MAX_JOB_SECONDS).

Each job below is run in this process through its kind's runner (what a worker calls), once to
warm up and then `--repeats` times; its throughput is the estimate app/limits.py gives its spec
(parameter-token-passes) divided by the median wall time. The JSON's `param_token_passes_per_s`
is the **lowest** of the jobs' throughputs, so a time limit turned into a cost ceiling with it is
conservative for every kind measured (a job estimated at the limit runs at most that long on
this machine, give or take the spread shown).

    python benchmarks/bench_throughput.py                     # zoo models, CPU or the GPU found
    python benchmarks/bench_throughput.py --out /srv/fisherlens/throughput.json

It also runs `fisherlens calibrate`'s measurement (compute.lm.calibrate: seconds = token_passes x
(a + b x params)) and writes its a and b into the same file, so the file is a calibration too:
the committed one (benchmarks/results/throughput.json) is what estimates use, labelled "the
reference machine's, not this machine's", where a machine has no calibration of its own (a single
constant measured on the 108,800-parameter zoo model priced SmolLM2-135M's default Fisher, 101 s,
at 12.8 days).

Run it on a worker machine and point THROUGHPUT_FILE at its output (or put it at
$FISHERLENS_HOME/throughput.json); the web reads the file, it never runs the benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (label, kind, spec): small enough to run in minutes on two busy CPU cores. Start-up costs
# (loading, tokenizing, saving a trained model) are part of every real job, so they are kept.
JOBS: list[tuple[str, str, dict[str, Any]]] = [
    ("fisher sequence", "fisher", {"model": "arith-base", "prompts": 8, "samples": 4,
                                   "max_new_tokens": 16}),
    ("train sft", "train", {"model": "arith-base", "algo": "sft", "steps": 4, "batch": 8,
                            "eval_prompts": 8, "bound": False}),
    ("train grpo", "train", {"model": "arith-base", "algo": "grpo", "steps": 2, "batch": 2,
                             "group": 4, "eval_prompts": 8, "bound": False}),
]


class _Progress:
    """What a runner calls to report progress (a worker writes it to the job row)."""

    artifacts: list[Any] = []

    def __call__(self, fraction: float, message: str = "") -> None:
        pass

    def check(self, force: bool = False) -> None:
        pass


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up run of each job")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "throughput.json")
    ap.add_argument("--home", type=Path, default=None,
                    help="FISHERLENS_HOME with the zoo (default: a temporary one, zoo installed)")
    args = ap.parse_args(argv)

    import torch

    from app import limits
    from compute.contract.settings import Settings
    from compute.jobs.registry import parse_spec
    from compute.jobs.runners import get_runner
    from compute.zoo import build_zoo

    if args.threads:
        torch.set_num_threads(args.threads)
    home = args.home or Path(tempfile.mkdtemp(prefix="fl-bench-tp-"))
    if not (home / "zoo" / "arith-base" / "config.json").exists():
        build_zoo(home / "zoo")
    os.environ["FISHERLENS_HOME"] = str(home)
    settings = Settings(fisherlens_home=home, database_url=None, redis_url=None)

    rows = []
    for label, kind, data in JOBS:
        spec = parse_spec(kind, data)
        est = limits.estimate(settings, kind, spec, limits.refs_for_estimate(settings, kind, spec))
        run = get_runner(kind)
        if not args.no_warmup:
            run(spec, _Progress())  # warm-up: imports, first-call allocations
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run(spec, _Progress())
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rows.append({"job": label, "kind": kind, "spec": data, "cost": est["cost"],
                     "params": est["params"], "token_passes": est["token_passes"],
                     "seconds": times, "median_s": med, "throughput": est["cost"] / med})
        print(f"{label:16s} cost {est['cost']:.3g}  median {med:7.2f} s  "
              f"[{min(times):.2f}, {max(times):.2f}]  {est['cost'] / med:.3g} /s", flush=True)

    slowest = min(rows, key=lambda r: r["throughput"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from compute.lm.calibrate import calibrate

    cal = calibrate(device)
    print(f"calibration: a = {cal['seconds_per_token_pass']:.3g} s per token-pass, "
          f"b = {cal['seconds_per_param_token_pass']:.3g} s per parameter-token-pass", flush=True)
    out = {
        # the calibrated cost model (what app/ceiling.calibration reads) ...
        "model": cal["model"],
        "seconds_per_token_pass": cal["seconds_per_token_pass"],
        "seconds_per_param_token_pass": cal["seconds_per_param_token_pass"],
        "calibration": {k: v for k, v in cal.items() if k not in (
            "model", "seconds_per_token_pass", "seconds_per_param_token_pass", "param_token_passes_per_s")},
        # ... and the one constant of the real jobs below (a cost ceiling's conversion)
        "param_token_passes_per_s": slowest["throughput"],
        "from_job": slowest["job"],
        "jobs": rows,
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor()
        or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "load_average_at_end": os.getloadavg()[0],
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/bench_throughput.py " + " ".join(argv or sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"throughput {out['param_token_passes_per_s']:.3g} parameter-token-passes/s "
          f"(slowest: {slowest['job']}) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
