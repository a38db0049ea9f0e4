"""Every table the README quotes, written from a committed result file.

    python benchmarks/readme_tables.py            # rewrite the tables in README.md
    python benchmarks/readme_tables.py --check    # exit 1 if any table differs (what the test runs)
    python benchmarks/readme_tables.py --print retention_default

The README holds each table between markers:

    <!-- table:retention_default -->
    ...generated, do not edit...
    <!-- /table -->

A table is a registry entry: marker name -> committed source file (JSON, under benchmarks/results/)
+ a renderer (loaded JSON -> markdown). Every rendered table ends with where its numbers came from:
the command, the git commit and the sha256 of the model weights that made the source file, so a
README number can be traced and cannot drift from its file (tests/unit/test_readme_tables.py fails
when it does).

Adding a table: write a renderer `def render_x(data: dict) -> str` below and register it:

    register("bench_fisher", "benchmarks/results/bench_fisher-latest.json", render_x)

then put `<!-- table:bench_fisher --> <!-- /table -->` in README.md and run this script. The
source path may be a glob (the newest match by name is used) for benchmarks that write
timestamped files. Lives in benchmarks/ because the top level is fixed and the sources are
benchmarks/results/*.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Files whose marked tables are generated (the README, and result notes that quote the same tables).
FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         "benchmarks/results/retention_default.md"]
# A local scratch folder in a recorded command says nothing to a reader (and names the recording
# machine's layout): `--out /tmp/x` -> `--out OUT`, `FISHERLENS_HOME=/tmp/x ` dropped.
_SCRATCH_ENV = re.compile(r"\b[A-Z_]+=/tmp/\S*\s+")
_SCRATCH_PATH = re.compile(r"(?<![\w/])/tmp/[^\s`'\"]+")


def public_command(command: str) -> str:
    """A recorded command as a reader can rerun it: scratch folders replaced by OUT."""
    return _SCRATCH_PATH.sub("OUT", _SCRATCH_ENV.sub("", command.strip()))
MARKER = re.compile(r"<!-- table:([A-Za-z0-9_.-]+) -->\n(.*?)<!-- /table -->", re.S)


@dataclass(frozen=True)
class TableSource:
    name: str
    source: str  # path relative to the repository root (JSON); a glob picks the newest by name
    render: Callable[[dict[str, Any]], str]

    def path(self, root: Path = ROOT) -> Path:
        if any(c in self.source for c in "*?["):
            matches = sorted(glob.glob(str(root / self.source)))
            if not matches:
                raise FileNotFoundError(f"table {self.name}: no file matches {self.source}")
            return Path(matches[-1])
        return root / self.source

    def generate(self, root: Path = ROOT) -> str:
        path = self.path(root)
        data = json.loads(path.read_text())
        body = self.render(data).rstrip("\n")
        rel = path.relative_to(root).as_posix()
        return f"{body}\n\n{provenance_line(data, rel)}\n"


TABLES: dict[str, TableSource] = {}


def register(name: str, source: str, render: Callable[[dict[str, Any]], str]) -> None:
    if name in TABLES:
        raise ValueError(f"table {name!r} is already registered")
    TABLES[name] = TableSource(name, source, render)


def provenance_line(data: dict[str, Any], rel: str) -> str:
    """`Source: FILE, made by `COMMAND` at commit C; models: name sha256 ...` (what is recorded)."""
    prov = data.get("provenance") or (data.get("meta") or {}).get("provenance") or {}
    parts = [f"Source: `{rel}`"]
    command = prov.get("command") or data.get("command") or (data.get("meta") or {}).get("command")
    if command:
        parts.append(f"made by `{public_command(command)}`")
    git = prov.get("git") or {}
    if git.get("commit"):
        parts.append(f"at commit {git['commit'][:10]}" + (" (with local changes)" if git.get("dirty") else ""))
    models = []
    for name, m in (prov.get("models") or {}).items():
        shas = m.get("sha256") or {}
        if shas:
            models.append(f"{name} " + ", ".join(f"{f} sha256 {s[:12]}" for f, s in sorted(shas.items())))
        elif m.get("revision"):
            models.append(f"{name} revision {m['revision'][:12]}")
    if not models and data.get("model_weights_sha256"):
        models.append(f"model weights sha256 {data['model_weights_sha256'][:12]}")
    if models:
        parts.append("models: " + "; ".join(models))
    if prov.get("wall_seconds") is not None:
        machine = prov.get("machine") or {}
        parts.append(f"{prov['wall_seconds'] / 60:.1f} min wall, {prov.get('cpu_seconds', 0) / 60:.1f} CPU-min "
                     f"on {machine.get('cpus', '?')} cores")
    return "<sub>" + "; ".join(parts) + ". Regenerate with `python benchmarks/readme_tables.py`.</sub>"


# ---------------------------------------------------------------------------------------------
# renderers
# ---------------------------------------------------------------------------------------------


def _eval_origin(s: dict[str, Any]) -> str:
    """Whether the held-out prompt count came from the SE target (ceil(0.25 / se^2)) or was given."""
    import math

    target = (s.get("eval") or {}).get("eval_se_target")
    if target and s.get("eval_prompts") == math.ceil(0.25 / target**2):
        return f"target SE {target}"
    return "set by --eval-prompts, not by the SE target"


def render_retention(data: dict[str, Any]) -> str:
    """A `fisherlens retention` result (OUT/retention.json): the table of compute.studies.retention."""
    from compute.studies.retention import markdown_table

    s = data["summary"]
    st = s.get("settings") or {}
    f = st.get("fisher") or {}
    settings = (
        f"Settings: {s.get('algo')} on `{s.get('task')}`, {st.get('optimizer')} lr {st.get('lr')}, "
        f"{st.get('steps')} steps x {st.get('batch')} prompts x {st.get('group')} completions, "
        f"precision {st.get('precision', 'fp32')}; initial Fisher {s.get('fisher', {}).get('estimator')} "
        f"({f.get('prompts')} prompts x {f.get('samples')} samples); seeds {s.get('seeds_used')} "
        f"(full and masked runs share each seed); {s.get('eval_prompts')} held-out prompts "
        f"({_eval_origin(s)}), greedy; "
        f"{s.get('bootstrap')} bootstrap replicates."
    )
    return markdown_table(s) + "\n" + settings + "\n"


register("retention_default", "benchmarks/results/retention_default.json", render_retention)


def _g(x: Any, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def _covered(s: dict[str, Any]) -> str:
    """`all 79` when the vocabulary was enumerated, else `1024 of 49152 (0.994)`: the bounds'
    slack is the uncovered probability's unknown share of the trace."""
    if s["fisher_exact"]:
        return f"all {s['vocab_size']}"
    return f"{s['covered_tokens']} of {s['vocab_size']} ({s['covered_mass']:.3f})"


def render_tokens(data: dict[str, Any]) -> str:
    """Per context: trace F against F_orth (sensitivities made mutually orthogonal), exact when
    the vocabulary was enumerated, bounds otherwise (compute.studies.tokens)."""
    lines = [
        "| model | context | top-1 (p) | mean cos top-k | mean cos random | trace F | F_orth "
        "| F_orth - F (share of F_orth) | top-k pairs only | tokens enumerated (p covered) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in data["contexts"]:
        s = c["summary"]
        sim = s["similarity"]
        t = s["top_tokens"][0]
        if sim["exact"]:
            f, fo = _g(sim["trace_f"]), _g(sim["trace_f_orth"])
            removed = f"{_g(sim['removed'], '+.4g')} ({_g(sim['removed_share'], '+.3f')})"
        else:
            f, fo = f">= {_g(sim['trace_f_lower'])}", f">= {_g(sim['trace_f_orth_lower'])}"
            removed = f"<= {_g(sim['removed_upper'], '+.4g')} (<= {_g(sim['removed_share_upper'], '.3f')})"
        ctx = s["context"].replace("|", "\\|")
        lines.append(
            f"| {c['model']}{'' if s.get('scope', 'model') == 'model' else ' (' + s['scope'] + ')'} | `{ctx}` | `{t['token'].strip() or repr(t['token'])}` ({t['prob']:.2f}) "
            f"| {_g(s.get('mean_cosine_top'), '+.3f')} | {_g(s.get('mean_cosine_random'), '+.3f')} | {f} | {fo} "
            f"| {removed} | {_g(sim['removed_top'], '+.4g')} | {_covered(s)} |")
    return "\n".join(lines) + "\n"


register("tokens_counterfactual", "benchmarks/results/tokens_counterfactual.json", render_tokens)


def render_fisher_reliability(data: dict[str, Any]) -> str:
    """benchmarks/fisher_reliability.py: the default Fisher's split-half Jaccard per prompt count."""
    by_prompts: dict[int, list[dict[str, Any]]] = {}
    for r in data["runs"]:
        by_prompts.setdefault(r["prompts"], []).append(r)
    seeds = sorted({r["seed"] for r in data["runs"]})
    lines = ["| prompts x samples | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|" + "---:|" * len(seeds)]
    for p, runs in sorted(by_prompts.items()):
        cells = {r["seed"]: f"{_g(r['split_half_jaccard'], '.3f')} ({r['verdict']})" for r in runs}
        lines.append(f"| {p} x {runs[0]['samples']} | " + " | ".join(cells.get(s, "-") for s in seeds) + " |")
    r0 = data["runs"][0]
    t = data["thresholds"]
    k = r0["split_half_topk_percent"]
    lines += ["", f"Split-half top-{k:g}% Jaccard of `fisherlens fisher --model {r0['model']} --prompts P "
              f"[--seed S]` ({r0['estimator']} estimator, every other option at its default); verdict fair >= "
              f"{t['fair']:g}, reliable >= {t['reliable']:g}; two random top-{k:g}% sets: "
              f"{(k / 100) / (2 - k / 100):.4f}."]
    return "\n".join(lines) + "\n"


register("fisher_reliability", "benchmarks/results/fisher_reliability.json", render_fisher_reliability)


def _bench_tables() -> Any:
    """benchmarks/tables.py (the benchmark JSON -> markdown renderers), imported by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "benchmarks" / "tables.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def render_bench_fisher(data: dict[str, Any]) -> str:
    return _bench_tables().fisher_table(data) + "\n"


def render_bench_masked(data: dict[str, Any]) -> str:
    return _bench_tables().masked_table(data) + "\n"


def render_sweep(data: dict[str, Any]) -> str:
    """A `fisherlens sweep` result (OUT/sweep.json): the points table of compute.jobs.sweep_run."""
    from compute.jobs.sweep_run import markdown_table

    return markdown_table(data["points"]) + "\n"


def render_share(data: dict[str, Any]) -> str:
    """benchmarks/bench_share.py: N concurrent readers of /r/<token> against one uvicorn process."""
    lines = [
        f"{data['readers']} concurrent readers for {data['seconds']:.0f} s, keep-alive, gzip, on "
        f"{data['cpus']} cores.",
        "",
        "| database | requests | req/s | p50 ms | p95 ms | p99 ms | errors | load average before |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["runs"]:
        errors = sum(n for code, n in r["status_codes"].items() if code != "200")
        lines.append(
            f"| {r['db']} | {r['requests']} | {r['throughput_rps']:.0f} | {r['p50_ms']:.0f} "
            f"| {r['p95_ms']:.0f} | {r['p99_ms']:.0f} | {errors} | {r['machine_before']['loadavg'][0]:.1f} |")
    browser = [r for r in data["runs"] if r.get("browser")]
    if browser:
        lines += ["", "In headless Chromium (seconds, median (max) of the openings; 'explorer' is the "
                  "result tab of the Gradio app):", "",
                  "| database | share page: all figures drawn | explorer reopen, page load included "
                  "| explorer: header -> all figures | explorer: switch result |",
                  "|---|---:|---:|---:|---:|"]
        for r in browser:
            b = r["browser"]
            cell = [f"{b[k + '_median_s']:.2f} ({b[k + '_max_s']:.2f})"
                    for k in ("share_page", "ui_result_tab", "ui_header_to_figures", "ui_switch")]
            lines.append(f"| {r['db']} | " + " | ".join(cell) + " |")
    return "\n".join(lines) + "\n"


def render_zoo(data: dict[str, Any]) -> str:
    """compute/zoo_weights/manifest.json: the shipped zoo models and their held-out accuracy."""
    lines = ["| model | layers | params | held-out accuracy | model.safetensors sha256 |",
             "|---|---:|---:|---:|---|"]
    for name, m in data["models"].items():
        lines.append(f"| {name} | {m['n_layers']} | {m['params']:,} | {m['accuracy']:.1%} "
                     f"({m['accuracy_decoding']}, {m['accuracy_prompts']} {m['accuracy_split']} prompts) "
                     f"| {m['files']['model.safetensors']} |")
    return "\n".join(lines) + "\n"


register("zoo", "compute/zoo_weights/manifest.json", render_zoo)


def render_real_models(data: dict[str, Any]) -> str:
    """benchmarks/real_models.py: each real model converted from scratch (`fisherlens zoo add`),
    its recorded greedy check, and the sequence Fisher engine against the float32 brute force."""
    lines = ["| model | architecture | layers | params | from | greedy (float32) | `fisherlens zoo add`: "
             "wall / CPU (load avg before) | engine vs brute force: relative L1 total / worst tensor "
             "| passes |",
             "|---|---|---:|---:|---|---|---:|---|---|"]
    notes = []
    for name, m in data["models"].items():
        conv = m["conversion"]
        timing = (f"{conv['wall_seconds']:.0f} s / {conv['cpu_seconds']:.0f} s "
                  f"({conv['loadavg_before'][0]:.1f})")
        if conv.get("gguf_already_joined"):
            notes.append(f"{name}: the package's GGUF chunks were already joined in its cache, "
                         "so the conversion time leaves out joining them.")
        if m.get("error"):
            lines.append(f"| {name} | - | - | - | - | - | {timing} | could not be converted: "
                         f"{m['error'].replace('|', '/')} | no |")
            continue
        src = m["source"]
        facts = "; ".join(f"\"{f['prompt']}\" -> `{f['completion']!r}`" for f in m["greedy_facts"])
        e = m["engine_check"]
        worst = (f"{e['worst_tensor_relative_l1']:.1e} (`{e['worst_tensor']}`)"
                 if e["worst_tensor"] else "n/a")
        lines.append(
            f"| {name} | {m['architecture']} | {m['n_layers']} | {m['params']:,} | {src['package']} "
            f"{src['package_version']} ({src['quantisation']} -> {m['dtype']}) | {facts} | {timing} "
            f"| {e['total_relative_l1']:.1e} / {worst} | {'yes' if e['passes'] else 'NO'} |")
        if e["unreached_tensors"]:
            zero = all(v == 0 for v in e["unreached_tensors"].values())
            notes.append(f"{name}: {len(e['unreached_tensors'])} tensor(s) no row reaches "
                         f"({', '.join(f'`{k}`' for k in sorted(e['unreached_tensors']))}), "
                         f"{'zero in the engine too' if zero else 'NON-ZERO in the engine'}.")
    first = next((m["engine_check"] for m in data["models"].values() if "engine_check" in m), None)
    if first:
        t = first["thresholds"]
        texts = ", ".join(f"\"{x}\"" for x in data["texts"])
        lines += ["", f"Engine check: the sequence Fisher (`batch_size` {first['batch_size']}, "
                  f"{first['dtype']}, CPU) of {first['rows']} rows ({texts}; the first "
                  f"{data['prompt_tokens']} tokens of each are the prompt) against one backward per "
                  f"row (`compute/fisher/reference.py`); passes: relative L1 <= {t['total']:g} over all "
                  f"tensors and <= {t['per_tensor']:g} for each. Greedy: the converted folder loaded as "
                  "fisherlens loads it, 3 new tokens.", *([" ".join(notes)] if notes else [])]
    return "\n".join(lines) + "\n"


register("real_models", "benchmarks/results/real_models.json", render_real_models)

def render_bench_scale(data: dict[str, Any]) -> str:
    """The Fisher job at growing size (benchmarks/bench_scale.py)."""
    budget = data["budget_mb"]
    lines = ["| model | params | peak above the weights | bytes/param above the weights | "
             f"bytes/param beyond the {budget} MiB budget | job / floor | Fisher / one forward+backward | "
             "where the job's time went |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in data["rows"]:
        h, layers = r["shape"][0], r["shape"][1]
        parts = r.get("seconds_parts") or {}
        went = ", ".join(f"{k} {v:.1f} s" for k, v in parts.items() if v >= 0.05) or "-"
        lines.append(f"| random Llama {r['size']} (hidden {h}, {layers} layers) | {r['n_params']:,} | "
                     f"{r['peak_above_weights_mb']:.0f} MiB | {r['bytes_per_param_above_weights']:.1f} | "
                     f"{r['bytes_per_param_beyond_budget']:.1f} | {r['job_over_floor']:.2f}x "
                     f"({r['job_s']:.1f} s / {r['floor_s']:.1f} s) | {r['fisher_over_forward_backward']:.2f}x | "
                     f"{went} |")
    m = data["meta"]
    load = ", ".join(f"{x:.1f}" for x in m.get("load_avg_after", []))
    lines += ["", f"Settings: {data['settings']}, {budget} MiB temporaries budget, {m['threads']} torch "
              f"thread{'s' if m['threads'] != 1 else ''}; floor = sampling the job's completions + one batched forward+backward over them, "
              f"timed in the same process. Load average after the run: {load} (a shared machine: ratios, "
              "not absolute times)."]
    return "\n".join(lines) + "\n"


register("bench_scale", "benchmarks/results/bench_scale.json", render_bench_scale)
register("bench_scale_workload", "benchmarks/results/bench_scale_workload.json", render_bench_scale)


def _spec_text(spec: dict[str, Any]) -> str:
    shown = {k: v for k, v in spec.items() if k not in ("fisher", "tuned", "run_dir")}
    refs = [k for k in ("fisher", "tuned", "run_dir") if k in spec]
    text = ", ".join(f"{k} {v}" for k, v in shown.items()) or "defaults"
    return text + (f" ({', '.join(refs)}: an earlier case's output)" if refs else "")


def render_bench_estimates(data: dict[str, Any]) -> str:
    """Every kind's default spec: the calibrated estimate against the clock and the predicted peak
    memory against the measured one (benchmarks/bench_estimates.py)."""
    lines = ["| case | spec (else the defaults) | estimated | measured | estimate / measured | "
             "predicted peak | measured peak | predicted / measured |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        if r.get("helper"):
            continue
        e, m = r["estimate"], r["measured"]
        mem = e.get("memory_bytes")
        lines.append(
            f"| {r['name']} | {_spec_text(r['spec'])} | {e['seconds']:.1f} s | {m['seconds']:.1f} s | "
            f"{r['ratio']:.2f} | {mem / 2**20:,.0f} MiB | {m['peak_mib']:,.0f} MiB | "
            f"{r['memory_ratio']:.2f} |")
    c = data["calibration"]
    ratios = [r["ratio"] for r in data["rows"] if not r.get("helper")]
    mems = [r["memory_ratio"] for r in data["rows"] if not r.get("helper")]
    loads = [r["load"]["before"][0] for r in data["rows"]]
    lines += ["", f"Time ratios {min(ratios):.2f} to {max(ratios):.2f} (goal: within 0.5 to 2); memory "
              f"ratios {min(mems):.2f} to {max(mems):.2f} (goal: within 1/1.3 to 1.3). Calibration in "
              f"the same process, just before: a = {c['seconds_per_token_pass']:.3g} s, b = "
              f"{c['seconds_per_param_token_pass']:.3g} s ({c['device']}, {c['dtype']}, "
              f"{c['threads']} threads); load average {min(loads):.1f} to {max(loads):.1f} during the "
              "run (a shared 2-core machine: the estimate and the clock see the same load). Measured: "
              "the runner's `run(spec, progress)` in a fresh process, wall time and RSS high-water "
              "mark above the RSS before the job."]
    for r in data["rows"]:
        if r.get("calibration"):
            c2 = r["calibration"]
            lines += ["", f"{r['name']}: measured in a later run with its own calibration just before "
                      f"it (a = {c2['seconds_per_token_pass']:.3g} s, b = "
                      f"{c2['seconds_per_param_token_pass']:.3g} s, load average "
                      f"{r['load']['before'][0]:.1f}), spec {_spec_text(r['spec'])}."]
    for r in data.get("superseded_rows") or []:
        lines += ["", f"Superseded: {r['name']} with {_spec_text(r['spec'])}, measured earlier, "
                  f"took {r['measured']['seconds']:.0f} s (peak {r['measured']['peak_mib']:,.0f} MiB) "
                  f"at a load average of {r['load']['before'][0]:.1f} to {r['load']['after'][0]:.1f} "
                  f"(the first run's calibration ran at {data['load_before_calibration'][0]:.1f}); "
                  "replaced by the row in the table, measured back to back with its own calibration."]
    if data.get("reestimated_at"):
        lines.append("")
        lines.append(f"Estimates recomputed from the same measurements and calibration with "
                     f"`--reestimate` at {data['reestimated_at']} (after a change to a cost model).")
    return "\n".join(lines) + "\n"


register("bench_estimates", "benchmarks/results/bench_estimates.json", render_bench_estimates)
register("bench_fisher", "benchmarks/results/bench_fisher.json", render_bench_fisher)
register("bench_masked", "benchmarks/results/bench_masked.json", render_bench_masked)
register("sweep_bf16_mixed", "benchmarks/results/sweep_arith_base_bf16_mixed/sweep.json", render_sweep)
register("sweep_precision", "benchmarks/results/sweep_arith_base_precision/sweep.json", render_sweep)
register("sweep_deep_adamw", "benchmarks/results/sweep_arith_deep_base_adamw/sweep.json", render_sweep)
register("sweep_deep_sgd", "benchmarks/results/sweep_arith_deep_base_sgd/sweep.json", render_sweep)
register("bench_share", "benchmarks/results/bench_share-*.json", render_share)


def render_explore(data: dict[str, Any]) -> str:
    """Drill-down timings (benchmarks/bench_explore.py): first and cached open of one tensor."""
    rows, cols = data["shape"]
    lines = [f"Tensor {rows:,} x {cols:,} float32 ({data['tensor_mb']:g} MB)"
             + (", file dropped from the page cache before the first open" if data.get("cold") else
                ", file in the page cache") + f"; {data['provenance']['machine'].get('cpus')} cores, load average "
             f"{data['provenance']['machine'].get('load_average_1min', '?')} at the end (other work shared them).", "",
             "| opened as | first open | its peak memory | cached open | view HTML from the cache | cached JSON |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in data["runs"]:
        lines.append(f"| {r['source']} | {r['first_open_s']:.2f} s | {r.get('first_open_peak_mb', 0):g} MB | "
                     f"{r['cached_open_s'] * 1000:.0f} ms | "
                     f"{r['view_html_s'] * 1000:.0f} ms | {r['cache_json_bytes'] / 1e6:.2f} MB |")
    return "\n".join(lines) + "\n"


register("bench_explore", "benchmarks/results/bench_explore.json", render_explore)
register("real_smollm2_retention", "benchmarks/results/real_smollm2/retention.json", render_retention)
register("real_smollm2_sweep", "benchmarks/results/real_smollm2/sweep.json", render_sweep)


def render_sgd_zeros(data: dict[str, Any]) -> str:
    """Where the SGD points' changed weights sit (issue 27): the sweep's |w| bins
    (fisher_auc_changed_by_binade), the w == 0 bin against all the others."""
    lines = ["| optimizer | lr | changed (all) | weights exactly 0 in the base | of them changed | "
             "changed among nonzero weights |", "|---|---|---:|---:|---:|---:|"]
    for p in data["points"]:
        if p.get("optimizer") != "sgd":
            continue
        bins = p.get("fisher_auc_changed_by_binade") or []
        zero = next((b for b in bins if b["exponent"] == -1000), {"n": 0, "n_changed": 0})
        n = sum(b["n"] for b in bins)
        changed = sum(b["n_changed"] for b in bins)
        lines.append(f"| {p['optimizer']} | {p['lr']:g} | {changed:,} ({100 * changed / n:.4f}%) | {zero['n']:,} "
                     f"| {zero['n_changed']:,} | {changed - zero['n_changed']:,} |")
    return "\n".join(lines) + "\n"


register("sgd_zero_weights", "benchmarks/results/real_smollm2/sweep.json", render_sgd_zeros)


# ---------------------------------------------------------------------------------------------
# README update / check
# ---------------------------------------------------------------------------------------------


def markers(text: str) -> dict[str, str]:
    """marker name -> current content between its markers."""
    found: dict[str, str] = {}
    for m in MARKER.finditer(text):
        if m.group(1) in found:
            raise ValueError(f"README: table marker {m.group(1)!r} appears twice")
        found[m.group(1)] = m.group(2)
    return found


def update(text: str, root: Path = ROOT, tables: dict[str, TableSource] | None = None) -> str:
    """`text` with every marked table regenerated from its source. Unknown markers are an error."""
    tables = TABLES if tables is None else tables
    unknown = sorted(set(markers(text)) - set(tables))
    if unknown:
        raise KeyError(f"README: no registered table for marker(s) {', '.join(unknown)}; "
                       f"registered: {', '.join(sorted(tables)) or 'none'}")

    def sub(m: re.Match[str]) -> str:
        return f"<!-- table:{m.group(1)} -->\n{tables[m.group(1)].generate(root)}<!-- /table -->"

    return MARKER.sub(sub, text)


def stale(text: str, root: Path = ROOT, tables: dict[str, TableSource] | None = None) -> list[str]:
    """Names of the marked tables whose content differs from what their source generates."""
    tables = TABLES if tables is None else tables
    want = markers(update(text, root, tables))
    return [name for name, body in markers(text).items() if want[name] != body]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a README table differs from its source")
    ap.add_argument("--print", dest="show", metavar="NAME", help="print one generated table")
    ap.add_argument("files", nargs="*", help=f"files holding markers  [default: {' '.join(FILES)}]")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.show:
        print(TABLES[args.show].generate(), end="")
        return 0
    bad_total = 0
    for path in [Path(f) if Path(f).is_absolute() else ROOT / f for f in (args.files or FILES)]:
        if not path.is_file():
            continue
        text = path.read_text()
        if args.check:
            bad = stale(text)
            for name in bad:
                print(f"{path.name}: table {name!r} differs from {TABLES[name].source}; "
                      "run python benchmarks/readme_tables.py", file=sys.stderr)
            bad_total += len(bad)
            continue
        new = update(text)
        if new != text:
            path.write_text(new)
        print(f"{path.name}: {len(markers(new))} table(s) generated: {', '.join(markers(new)) or 'none'}")
    return 1 if bad_total else 0


if __name__ == "__main__":
    raise SystemExit(main())
