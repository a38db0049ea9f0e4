"""`fisherlens fisher`: estimate the diagonal Fisher of a model on a task, write it and its stats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from app.commands.common import report, run_job, spec_from_options, write_json
from app.commands.options import spec_options
from compute.jobs.fisher import FisherSpec


@click.command("fisher")
@spec_options(FisherSpec)
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="output dir")
def fisher(out: str, **options: Any) -> None:
    """Estimate the diagonal Fisher; write OUT/fisher.safetensors and OUT/stats.json."""
    spec, refs = spec_from_options("fisher", options)
    result = run_job("fisher", spec, refs)

    from safetensors.torch import save_file

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().float().contiguous().cpu() for n, t in result.tensors["fisher"].items()}
    save_file(tensors, str(out_dir / "fisher.safetensors"),
              metadata=result.metadata.get("fisher") or {"estimator": spec.estimator})
    write_json(out_dir / "stats.json", result.to_dict())
    report(result)
    click.echo(f"wrote {out_dir / 'fisher.safetensors'} and {out_dir / 'stats.json'}")


commands = [fisher]
