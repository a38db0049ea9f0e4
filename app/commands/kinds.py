"""One `fisherlens <kind>` command per registered job kind (compute.jobs.registry).

A kind's command runs the job in this process (the entry point the worker calls) with options
generated from its spec (app/commands/options.py) and its `cli_args` as positional arguments.
A kind may bring its own command with a tailored report (app/commands/fisher.py, training.py,
experiments.py, named like the kind); every other kind gets the generic one here, which writes
OUT/result.json, one OUT/<artifact>.safetensors per stored tensor set, OUT/<name> for each stored
file or folder (a trained model), OUT/result.html with the figures, and prints the summary.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from app.commands.common import fail, json_safe, run_job, spec_from_options, write_html, write_json
from app.commands.options import spec_options
from compute.contract.kinds import JobKind
from compute.jobs.registry import KINDS


def _summary_lines(summary: dict[str, Any]) -> list[str]:
    """`key: value` for the summary's scalar values (nested ones are in result.json)."""
    return [f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}"
            for k, v in summary.items() if isinstance(v, str | int | float | bool) or v is None]


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
        for name, path in result.files.items():
            shutil.move(str(path), str(out_dir / name))
        write_html(data, out_dir / "result.html")
        for line in _summary_lines(result.summary):
            click.echo(line)
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


def kind_commands(custom: Iterable[click.Command]) -> list[click.Command]:
    """One command per registered kind, in the registry's order: the kind's own command (from
    `custom`, matched by name) or the generic one. A custom command named after no kind is an
    error (a kind was removed and its command left behind)."""
    own = {str(c.name): c for c in custom}
    stale = sorted(set(own) - set(KINDS))
    if stale:
        raise RuntimeError(f"CLI commands for unknown job kinds: {', '.join(stale)}; "
                           f"registered kinds: {', '.join(KINDS)}")
    return [own.get(name) or generic_command(kind) for name, kind in KINDS.items()]
