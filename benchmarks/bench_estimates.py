"""Does the estimate match the clock? Every registered job kind's default spec, estimated by the
calibrated cost model (app/limits.py, app/ceiling.py) and then run through its real runner on
this machine (issue 27 item 3, issue 30 item 5).

    python benchmarks/bench_estimates.py                 # calibrate, run every kind, write the JSON
    python benchmarks/bench_estimates.py --reestimate    # recompute only the estimates (same
                                                         # calibration, same measurements) after a
                                                         # change to a cost model
    python benchmarks/readme_tables.py                   # the table in docs/results.md

One process calibrates (compute.lm.calibrate, the same as `fisherlens calibrate`) and then, back to
back, runs each case in a fresh child process (so each peak-memory figure starts from the same
allocator state): the child imports torch and the kind's runner, then times
`run(spec, progress)` (what the worker calls: model load, the job, its statistics and figures
data) and reads its RSS high-water mark above the RSS before the job (benchmarks/peakmem.py's
method: /proc/self/clear_refs, VmHWM). The ratio estimate/measured should lie in [0.5, 2] for time
and [1/1.3, 1.3] for memory. The load average before and after each case is recorded: the machine
may be shared, and a loaded machine slows the job and the calibration alike only if they run at
the same time, which is why they run back to back. A case that samples is recorded in the home's
database as a worker records its job (record_lengths), so a later case's estimate prices its
sampling by how long those completions ran, as on a real install after that job.

Default specs: the kind's spec defaults on the zoo model arith-base (what the New job form starts
with); the kinds that need a reference get the output of an earlier case (mask <- the Fisher, diff
<- the train's model, series <- a small helper train with checkpoints, which is not a case), and
tokens, whose form has no default context, gets its example "12+34=". Plus the Fisher of the real
SmolLM2-135M (`smollm2-135m`) with its default spec (or --smollm2-prompts N fewer prompts, stated
in the result).

Writes benchmarks/results/bench_estimates.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "bench_estimates.json"
HELPER_RUN = {"model": "arith-base", "steps": 4, "batch": 2, "group": 2, "save_steps": 2,
              "eval_prompts": 8, "bound": False, "concentration": False}


def cases(out: Path, smollm2_prompts: int | None) -> list[dict[str, Any]]:
    """(name, kind, spec, what it saves for later cases) in run order."""
    smol: dict[str, Any] = {"model": "smollm2-135m"}
    if smollm2_prompts:
        smol["prompts"] = smollm2_prompts
    return [
        {"name": "fisher", "kind": "fisher", "spec": {"model": "arith-base"},
         "save": {"fisher": str(out / "fisher.safetensors")}},
        {"name": "mask", "kind": "mask", "spec": {"fisher": str(out / "fisher.safetensors")}},
        {"name": "train", "kind": "train", "spec": {"model": "arith-base"},
         "save": {"model": str(out / "train_model")}},
        {"name": "run-folder (helper)", "kind": "train", "spec": HELPER_RUN, "helper": True,
         "save": {"model": str(out / "run_dir")}},  # the model folder holds checkpoint-N
        {"name": "diff", "kind": "diff", "spec": {"base": "arith-base", "tuned": str(out / "train_model")}},
        {"name": "series", "kind": "series", "spec": {"base": "arith-base", "run_dir": str(out / "run_dir")}},
        {"name": "tokens", "kind": "tokens", "spec": {"model": "arith-base", "context": "12+34="}},
        {"name": "sweep", "kind": "sweep", "spec": {"model": "arith-base"}},
        {"name": "retention", "kind": "retention", "spec": {}},
        {"name": "fisher smollm2-135m", "kind": "fisher", "spec": smol, "real": True},
        # held out: no constant was set from it (twice the samples, twice the completion length)
        {"name": "fisher smollm2-135m, held out", "kind": "fisher", "real": True, "held_out": True,
         "spec": {"model": "smollm2-135m", "prompts": 16, "samples": 8, "max_new_tokens": 32}},
        # a real model's diff: SmolLM2-135M against a copy with 5% of its coordinates moved
        # (perturbed_copy), where the comparison and the spectra take seconds, not milliseconds
        {"name": "diff smollm2-135m", "kind": "diff", "real": True,
         "spec": {"base": "smollm2-135m", "tuned": str(out / "smollm2-perturbed")},
         "prepare": {"perturbed_copy": ["smollm2-135m", str(out / "smollm2-perturbed")]}},
    ]


def perturbed_copy(name: str, dest: str) -> None:
    """The zoo model `name` copied to `dest` with 5% of every tensor's coordinates moved by
    N(0, 0.01) (seed 0), stored in its own dtype: a stand-in for a fine-tuned checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    from compute.contract.modelref import resolve_model

    if Path(dest).exists():
        return
    shutil.copytree(resolve_model(name), dest)
    g = torch.Generator().manual_seed(0)
    for f in Path(dest).glob("*.safetensors"):
        moved = {}
        for k, v in load_file(str(f)).items():
            x = v.float()
            moved[k] = (x + (torch.rand(x.shape, generator=g) < 0.05) * torch.randn(x.shape, generator=g) * 1e-2
                        ).to(v.dtype).contiguous()
        save_file(moved, str(f), metadata={"format": "pt"})


# ---------------------------------------------------------------- the child: one timed run


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def child(case: dict[str, Any]) -> dict[str, Any]:
    import gc

    import torch  # noqa: F401 - imported before the clock and the baseline, as in a worker
    import transformers  # noqa: F401

    from compute.jobs.registry import parse_spec
    from compute.jobs.runners import get_runner

    spec = parse_spec(case["kind"], case["spec"])
    runner = get_runner(case["kind"])
    trace: list[tuple[float, float, str]] = []
    t0 = 0.0

    def progress(fraction: float, message: str = "") -> None:
        head = " ".join(str(message).split()[:3])
        if not trace or trace[-1][2] != head:
            trace.append((round(time.perf_counter() - t0, 2), round(float(fraction), 3), head))

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    result = runner(spec, progress, refs=None)
    seconds = time.perf_counter() - t0
    peak_mib = (_status_kib("VmHWM") - before) / 1024
    for what, dest in (case.get("save") or {}).items():
        if what == "fisher":
            from safetensors.torch import save_file

            save_file({n: t.detach().float().contiguous() for n, t in result.tensors["fisher"].items()}, dest)
        else:
            shutil.move(str(result.files[what]), dest)
    if len(trace) > 80:
        trace = trace[:: len(trace) // 80 + 1]
    # the job's own account of its time, by its estimate's parts where the kind gives one (the
    # Fisher, train): the estimate compared part by part, not only in total
    parts = (getattr(result, "summary", None) or {}).get("seconds_parts")
    lengths = (getattr(result, "summary", None) or {}).get("completion_lengths")
    return {"seconds": seconds, "peak_mib": peak_mib, "rss_before_mib": before / 1024, "trace": trace,
            "seconds_parts": parts, "completion_lengths": lengths}


def record_lengths(case: dict[str, Any], lengths: dict[str, Any]) -> None:
    """A case that sampled is recorded in the home's database as a worker records a job that
    succeeded (its spec, its summary's completion_lengths), so later estimates on the same model
    and task price their sampling by how long its completions ran (app.limits.stop_history), as
    they would after that job on a real install. No estimate is kept with the row: the clock's
    corrections (app.limits.clock_corrections) learn only from jobs that kept theirs, so no later
    case's estimate is corrected by an earlier case's clock."""
    import hashlib

    from compute.contract.settings import get_settings
    from compute.jobs.registry import parse_spec
    from storage import repo
    from storage.db import migrated_session_factory

    spec = parse_spec(case["kind"], case["spec"]).model_dump(mode="json")
    with migrated_session_factory(get_settings().db_url)() as s:
        job = repo.create_job(session=s, kind=case["kind"], spec=spec,
                              spec_hash=hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest())
        job.summary = {"completion_lengths": lengths}
        s.commit()
        repo.mark_succeeded(session=s, job_id=job.id)


# ---------------------------------------------------------------- the parent


def estimate_of(case: dict[str, Any]) -> dict[str, Any]:
    from app import limits
    from compute.contract.settings import get_settings
    from compute.jobs.registry import parse_spec

    settings = get_settings()
    spec = parse_spec(case["kind"], case["spec"])
    est = limits.estimate(settings, case["kind"], spec, limits.refs_for_estimate(settings, case["kind"], spec))
    keep = ("token_passes", "params", "seconds", "seconds_from", "seconds_parts", "memory_bytes",
            "memory_parts", "memory_device", "completion_lengths_from")
    return {k: est.get(k) for k in keep}


def _ratios(row: dict[str, Any]) -> None:
    est, meas = row["estimate"], row["measured"]
    row["ratio"] = est["seconds"] / meas["seconds"] if est.get("seconds") and meas["seconds"] > 0 else None
    mem = est.get("memory_bytes")
    row["memory_ratio"] = (mem / (meas["peak_mib"] * 2**20)
                           if mem and meas["peak_mib"] > 0 else None)


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "FISHERLENS_HOME": str(home), "PYTHONPATH": str(ROOT),
            "CALIBRATE_ON_UP": "false", "TOKENIZERS_PARALLELISM": "false",
            "ALLOWED_MODEL_ROOTS": str(home / "out")}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(args.home or tempfile.mkdtemp(prefix="fl-bench-estimates-"))
    os.environ.update(_env(home))
    from compute.lm import calibrate as cal
    from compute.zoo import build_zoo

    build_zoo(home / "zoo", force=False)
    if not args.no_smollm2:
        from compute.zoo.real import add_real_model

        add_real_model(home / "zoo", "smollm2-135m")
    out = home / "out"
    out.mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []
    if args.resume:  # an interrupted run, same FISHERLENS_HOME: keep its calibration and rows
        old = json.loads(OUT.read_text())
        calibration, load0, rows = old["calibration"], old["load_before_calibration"], old["rows"]
        cal.write(home / "throughput.json", calibration)
        resumed = old.get("resumed", 0) + 1
    else:
        load0 = os.getloadavg()
        calibration = cal.calibrate(device="cpu")
        cal.write(home / "throughput.json", calibration)
        resumed = 0
    done = {r["name"] for r in rows}
    data: dict[str, Any] = {
        "benchmark": "bench_estimates",
        "command": " ".join(["python", *(a for a in sys.argv if a != "--resume")]),
        "resumed": resumed,  # times an interrupted run was continued (same home and calibration)
        "calibration": calibration, "load_before_calibration": load0, "rows": rows,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "smollm2_prompts": args.smollm2_prompts,
    }
    for case in cases(out, args.smollm2_prompts):
        if case.get("real") and args.no_smollm2:
            continue
        if (args.only and case["name"] not in args.only) or case["name"] in done:
            continue
        for name, dest in (case.get("prepare") or {}).values():
            perturbed_copy(name, dest)
        est = estimate_of(case)
        load_before = os.getloadavg()
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], env=_env(home),
                              capture_output=True, text=True, cwd=str(ROOT))
        if proc.returncode != 0:
            raise SystemExit(f"{case['name']} failed:\n{proc.stderr[-4000:]}")
        meas = json.loads(proc.stdout.strip().splitlines()[-1])
        row = {"name": case["name"], "kind": case["kind"], "spec": case["spec"],
               "helper": bool(case.get("helper")), "held_out": bool(case.get("held_out")),
               "estimate": est, "measured": meas,
               "load": {"before": load_before, "after": os.getloadavg()}}
        if meas.get("completion_lengths"):
            record_lengths(case, meas["completion_lengths"])
        _ratios(row)
        rows.append(row)
        print(f"{case['name']:<22} estimate {est.get('seconds') or 0:9.1f} s  measured "
              f"{meas['seconds']:8.1f} s  ratio {row['ratio'] or 0:6.2f}  memory "
              f"{(est.get('memory_bytes') or 0) / 2**20:8.0f} / {meas['peak_mib']:8.0f} MiB  "
              f"load {load_before[0]:.2f}", flush=True)
        write(data)
    data["load_after"] = os.getloadavg()
    return data


def reestimate(home: str | None) -> dict[str, Any]:
    """The committed measurements with the estimates of today's cost model, under the committed
    calibration (written to a scratch FISHERLENS_HOME so the estimate reads it)."""
    data = json.loads(OUT.read_text())
    scratch = Path(home or tempfile.mkdtemp(prefix="fl-bench-estimates-"))
    os.environ.update(_env(scratch))
    from compute.lm import calibrate as cal
    from compute.zoo import build_zoo

    build_zoo(scratch / "zoo", force=False)
    if any("smollm2" in json.dumps(r["spec"]) for r in data["rows"]):
        from compute.zoo.real import add_real_model

        add_real_model(scratch / "zoo", "smollm2-135m")
    cal.write(scratch / "throughput.json", data["calibration"])
    out = scratch / "out"
    out.mkdir(exist_ok=True)
    # the references of the measured run are gone: rebuild the files the estimate reads (headers)
    specs = {c["name"]: c for c in cases(out, data.get("smollm2_prompts"))}
    for row in data["rows"]:  # a case measured with its own spec (fewer SmolLM2 prompts)
        if row["name"] in specs and row.get("calibration"):
            # its paths were written as OUT/... (write): the scratch folder's again
            spec = json.loads(json.dumps(row["spec"]).replace('"OUT/', json.dumps(str(scratch))[:-1] + "/"))
            specs[row["name"]] = {**specs[row["name"]], "spec": spec}
    for row in data["rows"]:
        # a row measured in a later run carries the calibration taken just before it
        cal.write(scratch / "throughput.json", row.get("calibration") or data["calibration"])
        case = specs.get(row["name"], {"kind": row["kind"], "spec": row["spec"]})
        for name, dest in (case.get("prepare") or {}).values():
            perturbed_copy(name, dest)
        if case.get("save") and not all(Path(p).exists() for p in case["save"].values()):
            subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], env=_env(scratch),
                           check=True, capture_output=True, cwd=str(ROOT))
        row["estimate"] = estimate_of(case)
        row["spec"] = case["spec"]
        if row["measured"].get("completion_lengths"):  # as measure() did: later rows price by them
            record_lengths(case, row["measured"]["completion_lengths"])
        _ratios(row)
    data["reestimated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return data


def merge(later: Path) -> dict[str, Any]:
    """The committed JSON with the rows of a later run (its own calibration, taken just before
    them, kept in each row) replacing the rows of the same name."""
    data, new = json.loads(OUT.read_text()), json.loads(later.read_text())
    rows = {r["name"]: r for r in new["rows"]}
    for r in rows.values():
        r["calibration"] = new["calibration"]
        r["load_before_calibration"] = new["load_before_calibration"]
        r["command"] = new["command"]
    data.setdefault("superseded_rows", []).extend(r for r in data["rows"] if r["name"] in rows)
    data["rows"] = [rows.pop(r["name"], r) for r in data["rows"]] + list(rows.values())
    return data


def write(data: dict[str, Any]) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    home = os.environ.get("FISHERLENS_HOME", "")
    text = json.dumps(data, indent=1)
    if home:
        text = text.replace(home, "OUT")  # the scratch folder says nothing to a reader
    OUT.write_text(text + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--home", default=None, help="FISHERLENS_HOME to use (default: a new temp folder)")
    ap.add_argument("--smollm2-prompts", type=int, default=None,
                    help="prompts of the SmolLM2 Fisher (default: its spec default, 64)")
    ap.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2-135M case")
    ap.add_argument("--only", nargs="*", help="only these case names")
    ap.add_argument("--resume", action="store_true",
                    help="continue the committed JSON's run in the same --home (skip measured cases)")
    ap.add_argument("--merge", default=None,
                    help="replace rows of the committed JSON by the rows of this later run's JSON")
    ap.add_argument("--reestimate", action="store_true",
                    help="recompute the estimates of the committed JSON; measure nothing")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.merge:
        write(merge(Path(args.merge)))
    elif args.reestimate:
        write(reestimate(args.home))
    else:
        write(measure(args))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
