"""The phenomenon on a real pretrained model: masked vs full GRPO and an lr x optimizer sweep in
bf16-mixed on SmolLM2-135M-Instruct, on a CPU (issue 19, item 3).

Two `fisherlens` commands, run one after the other as subprocesses (exactly what a user types):

1. `fisherlens retention`: full GRPO vs GRPO inside a 5% Fisher mask and inside a 5% random mask,
   paired seeds, held-out accuracy with bootstrap intervals (the paper's "fixed sparse masks keep
   most of the gain");
2. `fisherlens sweep`: lr x {AdamW, SGD} in bf16-mixed (fp32 master weights, bf16 checkpoint),
   each point diffed against the base (the paper's "bf16 update sparsity").

The task is benchmarks/data/smollm2_add.jsonl ("Q: 37 + 5 = ?\\nA: 37 + 5 =" -> " 42"): one the
model solves sometimes (0.30 of 100 held-out prompts before training, retention.json), so GRPO
groups carry signal.

Each command's CPU time (user + system of the child, `resource.getrusage(RUSAGE_CHILDREN)`) and
wall time are recorded with the result, so the "within 30 CPU-minutes" budget is a measured number,
not a promise. Writes benchmarks/results/real_smollm2/{retention,sweep}.json, which
benchmarks/readme_tables.py renders into the README.

    fisherlens zoo add smollm2-135m            # once (about 25 s)
    python benchmarks/real_smollm2.py          # about 30 CPU-minutes on 2 cores
    python benchmarks/real_smollm2.py --only sweep
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "real_smollm2"
TASK = "jsonl:benchmarks/data/smollm2_add.jsonl?match=numeric"
MODEL = "smollm2-135m"

# Shared by both commands: small batches, short completions, one Fisher estimate each.
COMMON = ["--model", MODEL, "--task", TASK, "--batch", "4", "--group", "4", "--max-new-tokens", "6",
          "--fisher-prompts", "16", "--fisher-samples", "4", "--device", "cpu"]

RUNS: dict[str, list[str]] = {
    "retention": ["retention", *COMMON, "--selectors", "fisher,random", "--densities", "0.05",
                  "--seeds", "1", "--steps", "10", "--lr", "3e-5", "--optimizer", "adamw",
                  "--eval-prompts", "100", "--bootstrap", "1000"],
    "sweep": ["sweep", *COMMON, "--lrs", "1e-6,1e-5,1e-4", "--optimizers", "adamw,sgd",
              "--precision", "bf16-mixed", "--steps", "6", "--eval-prompts", "50"],
}
OUTPUT = {"retention": "retention.json", "sweep": "sweep.json"}


def git() -> dict[str, Any]:
    def out(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": out("rev-parse", "HEAD"), "dirty": bool(out("status", "--porcelain", "--", "compute", "app"))}


def run(name: str, fisherlens: str) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"smol_{name}_"))
    argv = [fisherlens, *RUNS[name], "--out", str(work)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    print("$", shlex.join(argv), flush=True)
    subprocess.run(argv, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    data = json.loads((work / OUTPUT[name]).read_text())
    command = "fisherlens " + shlex.join(RUNS[name]) + " --out OUT"
    prov = data.get("provenance") or {}
    prov.update({
        "command": command, "git": git(), "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_after": list(os.getloadavg())},
        "script": "python benchmarks/real_smollm2.py --only " + name,
    })
    data["provenance"] = prov
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / OUTPUT[name]).write_text(json.dumps(data, indent=1) + "\n")
    md = work / OUTPUT[name].replace(".json", ".md")
    if md.exists():
        shutil.copy(md, RESULTS / md.name)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{name}: {wall / 60:.1f} min wall, {cpu / 60:.1f} CPU-min -> {RESULTS / OUTPUT[name]}", flush=True)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(RUNS), action="append", help="run only these (repeatable)")
    ap.add_argument("--fisherlens", default=str(Path(sys.executable).with_name("fisherlens")),
                    help="the fisherlens executable")
    args = ap.parse_args()
    for name in args.only or list(RUNS):
        run(name, args.fisherlens)


if __name__ == "__main__":
    main()
