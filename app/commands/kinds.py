"""One `fisherlens <kind>` command per registered job kind (compute.jobs.registry).

A kind's command runs the job in this process (the entry point the worker calls) with options
generated from its spec (app/commands/options.py) and its `cli_args` as positional arguments.
A kind may bring its own command with a tailored report (app/commands/fisher.py, training.py,
experiments.py, named like the kind); every other kind gets the generic one here, which writes
OUT/result.json, one OUT/<artifact>.safetensors per stored tensor set, OUT/<name> for each stored
file or folder (a trained model), OUT/result.html with the figures, and prints the key numbers
(app.commands.common.report: the browser's). A tailored command keeps only its output layout.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from app.commands.common import (
    fail,
    json_safe,
    report,
    run_job,
    spec_from_options,
    write_html,
    write_json,
)
from app.commands.options import spec_options
from compute.contract.kinds import JobKind
from compute.contract.specs import SpecError
from compute.jobs.registry import KINDS


def generic_command(kind: JobKind) -> click.Command:
    """`fisherlens <kind> [CLI_ARGS] [--options] --out OUT` for a kind without its own command."""

    def command(out: str, **options: Any) -> None:
        spec, refs = spec_from_options(kind.name, options)
        out_dir = Path(out)
        if out_dir.exists() and any(out_dir.iterdir()):
            fail(f"--out: {out} exists and is not empty; choose a new folder")
        result = run_job(kind.name, spec, refs)
        out_dir.mkdir(parents=True, exist_ok=True)
        data = json_safe(result.to_dict())
        write_json(out_dir / "result.json", data)
        if result.tensors:
            from safetensors.torch import save_file

            for name, tensors in result.tensors.items():
                save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()},
                          str(out_dir / f"{name}.safetensors"))
        for name, path in result.files.items():  # a plain file keeps its suffix (as the store does)
            suffix = Path(path).suffix if Path(path).is_file() else ""
            shutil.move(str(path), str(out_dir / f"{name}{suffix}"))
        write_html(data, out_dir / "result.html")
        report(result)
        click.echo(f"wrote {out_dir / 'result.json'}")

    doc = (kind.spec.__doc__ or "").strip().split("\n\n")[0]
    command.__doc__ = f"{kind.title}: run one {kind.name} job here; write OUT/result.json." + (
        f"\n\n{doc}" if doc else "")
    f: Any = click.option("--out", "out", required=True, type=click.Path(file_okay=False),
                          help="output folder: result.json, artifacts, result.html")(command)
    f = spec_options(kind.spec, exclude=kind.cli_args)(f)
    for name in reversed(kind.cli_args):
        f = click.argument(name)(f)
    return click.command(kind.name)(f)


def estimate_lines(kind: str, spec: Any) -> tuple[dict[str, Any], list[str]]:
    """(estimate, lines for a person): the time and memory a job of `spec` needs here, with
    their parts, and what the device has free (what --dry-run prints)."""
    from app import limits
    from app.ceiling import duration
    from compute.contract.settings import get_settings

    settings = get_settings()
    est = limits.estimate(settings, kind, spec, limits.refs_for_estimate(settings, kind, spec))
    lines = [limits.describe(est)]
    if est.get("seconds") is not None:
        parts = ", ".join(f"{p} {duration(v)}" for p, v in (est.get("seconds_parts") or {}).items()
                          if v >= 0.05)
        lines.append(f"time: about {duration(est['seconds'])}" + (f" ({parts})" if parts else ""))
    if est.get("memory_bytes"):
        parts = ", ".join(f"{p} {limits.size_text(v)}" for p, v in (est.get("memory_parts") or {}).items()
                          if v >= 1e5)
        free, where = limits.free_memory(settings, str(getattr(spec, "device", "auto")))
        has = f"; {where} has {limits.size_text(free)} free" if free is not None else ""
        lines.append(f"memory: {limits.memory_text(est)} at the peak ({parts}){has}{limits.host_text(est)}")
        for o in est.get("memory_options") or []:
            flags = " ".join(_flag(f, v) for f, v in o["change"].items())
            took = f", about {duration(o['seconds'])}" if o.get("seconds") is not None else ""
            lines.append(f"  with {flags}: about {limits.size_text(o['memory_bytes'])}{took}")
    return est, lines


def _flag(field: str, value: Any) -> str:
    """A spec change as the CLI spells it: --gradient-checkpointing, --dtype bfloat16."""
    name = "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return name if value else f"--no-{field.replace('_', '-')}"
    return f"{name} {value}"


def preflight(kind: str, options: dict[str, Any], dry_run: bool, yes: bool) -> None:
    """Before a job command runs: --dry-run prints the time and memory estimate and exits 0
    (nothing run, nothing submitted); a job that cannot fit the device's free memory exits 2 with
    both figures; a job estimated above CONFIRM_ABOVE_S asks y/N on a terminal, and without one
    exits 2 unless --yes."""
    from compute.jobs.registry import parse_spec

    data = {k: v for k, v in options.items() if v is not None and k in KINDS[kind].spec.model_fields}
    try:
        spec = parse_spec(kind, data)
    except SpecError as exc:
        if dry_run:
            fail("; ".join(f"--{e['field'].replace('_', '-')}: {e['message']}" for e in exc.errors))
        return  # the command reports it, flag by flag
    from app.ceiling import here
    from compute.contract.settings import get_settings

    if str(getattr(spec, "device", "auto")) != "cpu":
        import torch  # noqa: F401 - the job loads it next; its CUDA figures are this device's

    with here():  # this process runs the job: this machine's device, not the queue's workers'
        est, lines = estimate_lines(kind, spec)
        if dry_run:
            for line in lines:
                click.echo(line)
            click.echo("dry run: nothing was run or submitted")
            raise SystemExit(0)
        _checks(est, spec, yes, get_settings())


def _checks(est: dict[str, Any], spec: Any, yes: bool, settings: Any) -> None:
    from app import limits

    try:
        limits.check_memory(settings, est, spec)
        limits.check_confirm(est, yes)
    except limits.ConfirmationRequired as exc:
        message = exc.errors[0]["message"].split(": resend")[0]
        if not sys.stdin.isatty():
            fail(f"--yes: {message}; rerun with --yes to run it (no terminal to ask)")
        if not click.confirm(f"{message}. Run it?", default=False):
            fail("not confirmed: nothing was run", code=1)
    except SpecError as exc:
        fail("; ".join(f"{e['field']}: {e['message']}" for e in exc.errors))


def with_preflight(kind: str, command: click.Command) -> click.Command:
    """`command` with --dry-run and --yes (app/commands/kinds.py preflight) before it runs."""
    if any(p.name == "dry_run" for p in command.params):
        return command
    inner = command.callback
    assert inner is not None

    def callback(dry_run: bool, yes: bool, **options: Any) -> Any:
        preflight(kind, options, dry_run, yes)
        return inner(**options)

    callback.__doc__ = inner.__doc__
    command.callback = callback
    command.params += [
        click.Option(["--dry-run"], is_flag=True,
                     help="print the estimated time and peak memory and exit; run nothing"),
        click.Option(["--yes", "-y"], is_flag=True,
                     help="run without asking although the estimate is above CONFIRM_ABOVE_S"),
    ]
    return command


def kind_commands(custom: Iterable[click.Command]) -> list[click.Command]:
    """One command per registered kind, in the registry's order: the kind's own command (from
    `custom`, matched by name) or the generic one. A custom command named after no kind is an
    error (a kind was removed and its command left behind)."""
    own = {str(c.name): c for c in custom}
    stale = sorted(set(own) - set(KINDS))
    if stale:
        raise RuntimeError(f"CLI commands for unknown job kinds: {', '.join(stale)}; "
                           f"registered kinds: {', '.join(KINDS)}")
    return [with_preflight(name, own.get(name) or generic_command(kind)) for name, kind in KINDS.items()]
