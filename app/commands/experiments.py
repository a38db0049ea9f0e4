"""Experiment commands: `mask`, `diff`, `tokens`, `retention` (`train` and `sweep` are in
training.py). Options are generated from the spec models (app/commands/options.py). What each
keeps of its own is its output layout (the files it writes); what it prints is the result's key
numbers (app.commands.common.report), the same as the browser's.

Compute is imported inside each command so `fisherlens --help` stays light.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from app.commands.common import (
    json_safe,
    report,
    run_job,
    spec_command,
    spec_from_options,
    write_html,
    write_json,
)
from app.commands.options import spec_options
from compute.jobs.diff import DiffSpec
from compute.jobs.mask import MaskSpec
from compute.jobs.retention import RetentionSpec
from compute.jobs.tokens import TokensSpec


@click.command("mask")
@spec_options(MaskSpec, overrides={
    "fisher": {"help": "fisher.safetensors path (or a folder holding one) or job:<id>"},
    "model": {"help": "zoo name or local HF dir (weights for magnitude*, shapes for random)"}})
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="mask.safetensors to write")
def mask_cmd(out: str, **options: Any) -> None:
    """Build a boolean mask keeping exactly round(density x N) coordinates, and save it."""
    spec, refs = spec_from_options("mask", options)
    from compute.sparsity.masks import save_mask

    res = run_job("mask", spec, refs, f"mask {spec.select}")
    s = res.summary
    meta = {"select": spec.select, "density": s["density"], "density_requested": spec.density,
            "seed": spec.seed, "fisher": spec.fisher or "", "model": spec.model or "", "scores": s["scores"]}
    path = save_mask(res.tensors["mask"], out, meta)
    report(res)
    click.echo(f"wrote {path}")


# ---------------------------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------------------------


@click.command("diff")
@click.argument("base")
@click.argument("tuned")
@spec_options(DiffSpec, exclude=("base", "tuned"))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="output folder")
def diff_cmd(base: str, tuned: str, out: str, **options: Any) -> None:
    """Update sparsity of TUNED relative to BASE (zoo names, local HF dirs, training outputs)."""
    spec, refs = spec_from_options("diff", {"base": base, "tuned": tuned, **options})
    res = run_job("diff", spec, refs, "diff")
    out_dir = Path(out)
    result = json_safe(res.to_dict())
    write_json(out_dir / "diff.json", result)
    if res.tensors.get("delta"):
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in res.tensors["delta"].items()}, str(out_dir / "delta.safetensors"))
    write_html(result, out_dir / "diff.html")
    report(res)
    click.echo(f"wrote {out_dir / 'diff.json'}")


# ---------------------------------------------------------------------------------------------
# tokens
# ---------------------------------------------------------------------------------------------


@click.command("tokens")
@spec_options(TokensSpec, overrides={"context": {"help": "text before the next token"}})
@click.option("--out", "out", type=click.Path(dir_okay=False), help="write the result as JSON")
def tokens_cmd(out: str | None, **options: Any) -> None:
    """Next tokens after CONTEXT: probabilities, sensitivity cosines, shares of the Fisher."""
    spec, refs = spec_from_options("tokens", options)
    res = run_job("tokens", spec, refs, "tokens")
    report(res)
    if out:
        write_json(Path(out), json_safe(res.to_dict()))
        click.echo(f"wrote {out}")


# ---------------------------------------------------------------------------------------------
# retention
# ---------------------------------------------------------------------------------------------


def provenance(spec: Any, refs: dict[str, Any], seconds_wall: float, cpu_seconds: float,
               command: str) -> dict[str, Any]:
    """Where a result came from: the exact command, the code (git commit), the models (sha256 of
    every weight file, so a table says which zoo made it), the machine and the time it took."""
    import platform
    import subprocess

    from compute.contract.modelref import file_sha256, folder_revision

    models: dict[str, Any] = {}
    for field in ("model", "teacher"):  # the resolved refs (the default OPD teacher included)
        r = refs.get(field)
        if r is None:
            continue
        try:
            entry: dict[str, Any] = {"revision": r.path if r.form == "hub" else folder_revision(Path(r.where()))}
            if r.form != "hub":
                entry["sha256"] = {f.name: file_sha256(f) for f in sorted(Path(r.where()).iterdir())
                                   if f.is_file() and f.suffix in (".safetensors", ".bin")}
            models[r.given] = entry
        except (ValueError, OSError) as exc:
            models[r.given] = {"error": str(exc)}
    git: dict[str, Any] = {}
    try:
        root = Path(__file__).resolve().parents[2]
        git["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "compute", "app"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
        git["dirty"] = bool(dirty.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    import torch

    return {
        "command": command,
        "git": git, "models": models,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "wall_seconds": round(seconds_wall, 1), "cpu_seconds": round(cpu_seconds, 1),
    }


@click.command("retention")
@spec_options(RetentionSpec, overrides={"eval_prompts": {
    "help": "held-out prompts (overrides --eval-se)", "default_text": "ceil(0.25 / eval_se^2)"}})
@click.option("--out", "out", default="retention", show_default=True, type=click.Path(file_okay=False),
              help="writes OUT/retention.json, OUT/retention.md, OUT/rewards.safetensors")
def retention_cmd(out: str, **options: Any) -> None:
    """Full vs fixed-mask training from the initial Fisher: retention with confidence intervals.

    Every seed runs full training and each mask with the same seed; every model is evaluated on
    the same held-out prompts. No retention is reported when full training does not beat the
    base beyond its error."""
    import resource
    import time

    spec, refs = spec_from_options("retention", options)
    t0 = time.perf_counter()
    res = run_job("retention", spec, refs, "retention")
    ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(r.ru_utime + r.ru_stime for r in ru)
    s = res.summary
    out_dir = Path(out)
    result = json_safe({**res.to_dict(), "spec": spec.model_dump(mode="json"),
                        "provenance": provenance(spec, refs, time.perf_counter() - t0, cpu,
                                                 spec_command("retention", spec,
                                                                   **({"out": out} if out != "retention" else {})))})
    write_json(out_dir / "retention.json", result)
    (out_dir / "retention.md").write_text(s["markdown"])
    if res.tensors.get("rewards"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in res.tensors["rewards"].items()}, str(out_dir / "rewards.safetensors"))
    report(res)
    click.echo(f"{s['runs']} runs in {s['seconds']:.0f} s ({cpu:.0f} CPU-seconds); wrote "
               f"{out_dir / 'retention.json'} and {out_dir / 'retention.md'}")


commands: list[click.Command] = [mask_cmd, diff_cmd, tokens_cmd, retention_cmd]
# The training area's commands (train, sweep) are registered by app/commands/training.py.
