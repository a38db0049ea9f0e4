"""The split-half reliability of the default Fisher against its number of prompts: `fisherlens
fisher --model arith-base --prompts P --seed S` (every other option at its default: sequence
estimator, 4 samples per prompt, top-1% Jaccard) for P in 16, 32, 64 and a few seeds. Writes
benchmarks/results/fisher_reliability.json (`runs`: [{command, prompts, seed, split_half_jaccard,
verdict, ...}], `provenance`), which benchmarks/readme_tables.py renders; it is the measurement
behind FisherSpec's default of 64 prompts (compute/jobs/fisher.py).

Each run goes through the entry point `fisherlens fisher` uses (app.commands.common
spec_from_options -> run_job -> compute.jobs.fisher_run.run), so `command` remakes it. Seconds on
2 CPU cores for the defaults:

    FISHERLENS_HOME=/tmp/flzoo .venv/bin/python benchmarks/fisher_reliability.py \\
        --out benchmarks/results/fisher_reliability.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_one(model: str, prompts: int, seed: int) -> tuple[dict[str, Any], Any, Any]:
    """One `fisherlens fisher` run: its row, spec and refs."""
    from app.commands.common import run_job, spec_command, spec_from_options
    from compute.contract.results import reliability_level

    spec, refs = spec_from_options("fisher", {"model": model, "prompts": prompts, "seed": seed})
    t0 = time.perf_counter()
    res = run_job("fisher", spec, refs, f"fisher {prompts} prompts seed {seed}")
    s = res.summary
    jac = s.get("split_half_jaccard")
    row = {"command": spec_command("fisher", spec), "model": model, "prompts": prompts, "seed": seed,
           "samples": spec.samples, "estimator": spec.estimator, "n_rows": s.get("n_rows"),
           "split_half_jaccard": jac, "split_half_topk_percent": s.get("split_half_topk_percent"),
           "verdict": reliability_level(jac), "seconds_wall": round(time.perf_counter() - t0, 1)}
    return row, spec, refs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--model", default="arith-base", help="zoo name (default arith-base)")
    ap.add_argument("--prompts", default="16,32,64", help="comma list of prompt counts")
    ap.add_argument("--seeds", default="0,1,2", help="comma list of seeds (0 is the default spec's)")
    args = ap.parse_args(argv)
    from app.commands.common import json_safe
    from app.commands.experiments import provenance
    from compute.contract.results import FAIR_JACCARD, RELIABLE_JACCARD

    try:
        prompts = [int(p) for p in args.prompts.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error("--prompts/--seeds: give whole numbers separated by commas, e.g. 16,32,64")
    t0, c0 = time.perf_counter(), time.process_time()
    runs: list[dict[str, Any]] = []
    spec, refs = None, {}
    for p in prompts:
        for seed in seeds:
            row, spec, refs = run_one(args.model, p, seed)
            runs.append(row)
            print(f"{p} prompts seed {seed}: split-half Jaccard {row['split_half_jaccard']:.3f} "
                  f"({row['verdict']}) in {row['seconds_wall']} s", file=sys.stderr)
    home = os.environ.get("FISHERLENS_HOME", "")
    command = shlex.join([f"FISHERLENS_HOME={home}", ".venv/bin/python", "benchmarks/fisher_reliability.py",
                          *(argv if argv is not None else sys.argv[1:])])
    prov = provenance(spec, refs, time.perf_counter() - t0, time.process_time() - c0, command)
    # `command` starts with the row command (readme_tables' provenance check); `commands`: this run
    prov = {**prov, "command": "fisherlens fisher (the command of each row), run by: " + command,
            "commands": [command]}
    out = {"runs": runs, "thresholds": {"fair": FAIR_JACCARD, "reliable": RELIABLE_JACCARD},
           "provenance": prov}
    Path(args.out).write_text(json.dumps(json_safe(out), indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}: {len(runs)} runs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
