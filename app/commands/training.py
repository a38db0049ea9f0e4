"""`fisherlens train` (one full or masked post-training run) and `fisherlens sweep` (training
runs over lr x optimizer x precision). Options are generated from TrainSpec / SweepSpec."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import click

from app.commands.common import (
    fail,
    json_safe,
    report,
    run_job,
    spec_command,
    spec_from_options,
    write_html,
    write_json,
)
from app.commands.options import spec_options
from compute.jobs.sweep import SweepSpec
from compute.jobs.train import TrainSpec


@click.command("train")
@spec_options(TrainSpec, overrides={"mask": {"help": "mask.safetensors or job:<id>: train only its True coordinates"}})
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="output dir: the trained model (HF format), metrics.json")
def train_cmd(out: str, **options: Any) -> None:
    """Post-train MODEL on TASK (full, or masked), write the model and OUT/metrics.json."""
    spec, refs = spec_from_options("train", options)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        fail(f"--out: {out} exists and is not empty; choose a new folder")
    result = run_job("train", spec, refs)
    src = Path(result.files["model"])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        out_dir.rmdir()
    shutil.move(str(src), str(out_dir))
    shutil.rmtree(src.parent, ignore_errors=True)
    if "mask" in result.tensors:
        from compute.sparsity.masks import save_mask

        save_mask(result.tensors["mask"], out_dir / "mask.safetensors", metadata=result.summary.get("mask"))
    from safetensors.torch import save_file

    for kind in ("grad_sq_sum", "grad_abs_sum", "fisher"):
        if kind in result.tensors:
            save_file({n: t.contiguous() for n, t in result.tensors[kind].items()},
                      str(out_dir / f"{kind}.safetensors"))
    report(result)
    click.echo(f"wrote {out_dir} (model, tokenizer, metrics.json)")


def _weights_sha256(ref: Any) -> str | None:
    """sha256 of a local model's weights file(s) (what the sweep started from; `ref` the resolved
    model), None if not local."""
    import hashlib

    if ref is None or not ref.local or ref.form == "hub":
        return None
    folder = Path(ref.local)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


@click.command("sweep")
@spec_options(SweepSpec)
@click.option("--out", "out", default="sweep", show_default=True, type=click.Path(file_okay=False),
              help="writes OUT/sweep.json, OUT/sweep.md and OUT/sweep.html")
def sweep_cmd(out: str, **options: Any) -> None:
    """Update sparsity and the initial Fisher's AUCs across lr x optimizer x precision: one train +
    diff per grid point."""
    import resource
    import time

    from app.commands.experiments import provenance

    spec, refs = spec_from_options("sweep", options)
    t0 = time.perf_counter()
    result = run_job("sweep", spec, refs)
    cpu = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(w) for w in
                                                 (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    s = result.summary
    out_dir = Path(out)
    command = spec_command("sweep", spec)
    data = json_safe({**result.to_dict(), "points": s["points"], "spec": spec.model_dump(mode="json"),
                      "command": command, "model_weights_sha256": _weights_sha256(refs.get("model")),
                      "provenance": provenance(spec, refs, time.perf_counter() - t0, cpu, command)})
    write_json(out_dir / "sweep.json", data)
    (out_dir / "sweep.md").write_text(s["markdown"])
    write_html(data, out_dir / "sweep.html")
    report(result)
    click.echo(f"{len(s['points'])} points in {s['seconds']:.0f} s; wrote {out_dir / 'sweep.json'}, "
               f"{out_dir / 'sweep.md'} and {out_dir / 'sweep.html'}")


commands: list[click.Command] = [train_cmd, sweep_cmd]
