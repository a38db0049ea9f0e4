"""`fisherlens train` (one full or masked post-training run) and `fisherlens retention` (the
fixed-mask retention grid)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import click

from app.commands.common import cli_progress, fail, spec_from_options, write_json
from compute.specs import SweepSpec, TrainSpec


def _check_refs(spec: Any) -> None:
    from compute.modelref import resolve_model
    from compute.tasks import get_task

    try:
        from app.commands.experiments import allow_local_dirs

        allow_local_dirs(spec.model, getattr(spec, "teacher", None))  # folders named by the user
    except ImportError:  # pragma: no cover - the experiments module is another area's
        pass
    try:
        resolve_model(spec.model)
        if getattr(spec, "teacher", None):
            resolve_model(spec.teacher)
        get_task(spec.task)
    except ValueError as exc:
        fail(str(exc).splitlines()[0])


def _fmt(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


@click.command("train")
@click.option("--model", required=True, help="zoo name, local HF directory, or hub id")
@click.option("--task", help="arithmetic | arithmetic-add | arithmetic-mul | jsonl:PATH")
@click.option("--algo", help="grpo | opd | sft  [default: grpo]")
@click.option("--teacher", help="teacher model for opd (same tokenizer)")
@click.option("--mask", help="mask.safetensors: train only its True coordinates")
@click.option("--mask-select", help="build a mask in the run: fisher | fisher-tensor | fisher-bottom | "
              "random | magnitude | magnitude-bottom | gradient")
@click.option("--mask-density", type=float, help="density of --mask-select (0..1]")
@click.option("--optimizer", help="adamw | sgd  [default: adamw]")
@click.option("--lr", type=float, help=f"learning rate  [default: {TrainSpec.model_fields['lr'].default}]")
@click.option("--weight-decay", type=float, help="[default: 0]")
@click.option("--momentum", type=float, help="SGD momentum  [default: 0]")
@click.option("--steps", type=int, help=f"optimizer steps  [default: {TrainSpec.model_fields['steps'].default}]")
@click.option("--batch", type=int, help="prompts per step  [default: 8]")
@click.option("--group", type=int, help="completions per prompt  [default: 8]")
@click.option("--kl-coef", type=float, help="GRPO KL to the reference  [default: 0]")
@click.option("--clip-eps", type=float, help="GRPO ratio clip  [default: 0.2]")
@click.option("--sft-source", help="gold | self  [default: gold]")
@click.option("--distill-estimator", help="full | sampled  [default: full]")
@click.option("--max-new-tokens", type=int, help="sampled completion length  [default: 16]")
@click.option("--temperature", type=float, help="sampling temperature  [default: 1]")
@click.option("--grad-clip", type=float, help="max gradient norm  [default: 1]")
@click.option("--eval-prompts", type=int, help="held-out prompts for greedy accuracy  [default: 200]")
@click.option("--fisher-prompts", type=int, help="Fisher prompts for --mask-select fisher*")
@click.option("--fisher-samples", type=int, help="Fisher samples per prompt")
@click.option("--bound/--no-bound", default=None, help="GRPO: check the Fisher bound on batch 1 "
              "(Fisher from independent samples)")
@click.option("--precision", help="fp32 | bf16-mixed (fp32 master weights, bf16 checkpoint) | bf16 "
              "(bf16 weights)  [default: fp32]")
@click.option("--fisher", help="initial Fisher (fisher.safetensors or job:<id>) for the concentration "
              "and bound checks  [default: estimated from independent samples]")
@click.option("--independent-fisher", help="other-prompts | other-completions  [default: other-prompts]")
@click.option("--concentration/--no-concentration", default=None,
              help="accumulate sum g^2, sum |g| over the run and compare with the initial Fisher")
@click.option("--topk-percent", type=float, help="top-k%% of the concentration overlap  [default: 1]")
@click.option("--seed", type=int, help="[default: 0]")
@click.option("--device", help="auto | cpu | cuda | cuda:N")
@click.option("--dtype", help="auto | float32 | bfloat16 | float16")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="output dir: the trained model (HF format), metrics.json")
def train_cmd(out: str, **options: Any) -> None:
    """Post-train MODEL on TASK (full, or masked), write the model and OUT/metrics.json."""
    spec = spec_from_options("train", options)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        fail(f"--out: {out} exists and is not empty; choose a new folder")
    _check_refs(spec)
    from compute.run_train import run

    with cli_progress("train") as progress:
        try:
            result = run(spec, progress)
        except ValueError as exc:
            fail(str(exc).splitlines()[0])
    src = Path(result.files["model"])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        out_dir.rmdir()
    shutil.move(str(src), str(out_dir))
    shutil.rmtree(src.parent, ignore_errors=True)
    if "mask" in result.tensors:
        from compute.masks import save_mask

        save_mask(result.tensors["mask"], out_dir / "mask.safetensors", metadata=result.summary.get("mask"))
    from safetensors.torch import save_file

    for kind in ("grad_sq_sum", "grad_abs_sum", "fisher"):
        if kind in result.tensors:
            save_file({n: t.contiguous() for n, t in result.tensors[kind].items()},
                      str(out_dir / f"{kind}.safetensors"))
    s = result.summary
    click.echo(f"{spec.algo} on {spec.task}: held-out accuracy {_fmt(s['accuracy_before'])} -> "
               f"{_fmt(s['accuracy_after'])} ({s['settings']['steps']} steps, {s['seconds']:.1f} s, "
               f"trainable {s['trainable_fraction']:.2%})")
    us = s.get("update_sparsity", {})
    if us:
        click.echo(f"precision {s.get('precision', 'fp32')} (checkpoint stored in {us.get('stored_dtype')}): "
                   f"unchanged exact {_fmt(us.get('unchanged_exact'))}, bf16-equal "
                   f"{_fmt(us.get('unchanged_bf16'))}, |delta_bf16|<=1e-5 (published convention) "
                   f"{_fmt(us.get('unchanged_bf16delta_atol_1e-05'))}, |delta_fp32|<=1e-5 "
                   f"{_fmt(us.get('unchanged_atol_1e-05'))}")
        if us.get("fisher_auc_changed") is not None:
            click.echo(f"initial Fisher AUC for 'changed': {_fmt(us.get('fisher_auc_changed'))} (within |w| "
                       f"binades {_fmt(us.get('fisher_auc_changed_within_binades'))})")
    conc = s.get("concentration")
    if conc:
        for label, name in (("grad_sq_sum", "sum g^2"), ("grad_abs_sum", "sum |g|"), ("abs_delta", "|delta|")):
            g = conc.get(label, {}).get("global")
            if g:
                click.echo(f"initial Fisher vs {name} over the run (top {100 * conc['fraction']:g}%): "
                           f"precision@k {_fmt(g['precision_at_k'])}, AUC {_fmt(g['auc'])}, "
                           f"Spearman {_fmt(g['spearman'])}")
    if "bound" in s:
        b = s["bound"]
        if b.get("bound_independent"):
            q = b.get("bound_ratio_quantiles", {})
            click.echo(f"bound |g| <= sqrt(E A^2) sqrt(F_indep): {b['bound_violations']:,} violations of "
                       f"{b['bound_coordinates']:,} coordinates; ratio median {_fmt(q.get('p50'))}, p99 "
                       f"{_fmt(q.get('p99'))}, max {_fmt(b.get('bound_max_ratio'))}; training gradient = "
                       f"N/T x g with N/T {_fmt(b.get('bound_n_over_t'))}")
        else:
            click.echo("bound: no independent Fisher, so no check was made (the same-sample identity "
                       "holds by construction)")
    click.echo(f"wrote {out_dir} (model, tokenizer, metrics.json)")


def _floats(text: str | None, flag: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"{flag}: got {text!r}; expected comma-separated numbers like 0.01,0.05,0.1")


def _words(text: str | None) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def spec_command(kind: str, spec: Any) -> str:
    """The CLI command that reproduces `spec` (fields that differ from their defaults)."""
    parts = [f"fisherlens {kind}"]
    for name, f in type(spec).model_fields.items():
        v = getattr(spec, name)
        default = f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]
        if v == default:
            continue
        if isinstance(v, bool):
            parts.append(f"--{name.replace('_', '-')}" if v else f"--no-{name.replace('_', '-')}")
            continue
        text = ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v) if isinstance(v, list) else (
            f"{v:g}" if isinstance(v, float) else str(v))
        parts.append(f"--{name.replace('_', '-')} {text}")
    return " ".join(parts)


def _weights_sha256(ref: str) -> str | None:
    """sha256 of a local model's weights file(s) (what the sweep started from), None if not local."""
    import hashlib

    from compute.modelref import resolve_model

    try:
        folder = Path(resolve_model(ref))
    except ValueError:
        return None
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


@click.command("sweep")
@click.option("--model", required=True, help="zoo name, local HF directory, or hub id")
@click.option("--task", help="[default: arithmetic]")
@click.option("--algo", help="grpo | opd | sft  [default: grpo]")
@click.option("--teacher", help="teacher for opd (same tokenizer)")
@click.option("--lrs", help="comma-separated learning rates  [default: 1e-6,1e-5,1e-4,1e-3]")
@click.option("--optimizers", help="comma-separated: adamw,sgd  [default: adamw,sgd]")
@click.option("--precision", help="comma-separated: fp32, bf16-mixed, bf16  [default: bf16-mixed]")
@click.option("--steps", type=int, help=f"optimizer steps per point  [default: {SweepSpec.model_fields['steps'].default}]")
@click.option("--batch", type=int, help="prompts per step  [default: 8]")
@click.option("--group", type=int, help="completions per prompt  [default: 8]")
@click.option("--max-new-tokens", type=int, help="sampled completion length  [default: 16]")
@click.option("--eval-prompts", type=int, help="held-out prompts for greedy accuracy  [default: 200]")
@click.option("--weight-decay", type=float)
@click.option("--momentum", type=float, help="SGD momentum")
@click.option("--temperature", type=float)
@click.option("--kl-coef", type=float)
@click.option("--fisher", help="initial Fisher (fisher.safetensors)  [default: estimated once from "
              "independent samples]")
@click.option("--independent-fisher", help="other-prompts | other-completions")
@click.option("--fisher-prompts", type=int, help="prompts of the initial Fisher  [default: 32]")
@click.option("--fisher-samples", type=int, help="samples per prompt of the initial Fisher  [default: 4]")
@click.option("--topk-percent", type=float, help="top-k%% of the Fisher/gradient overlap  [default: 1]")
@click.option("--seed", type=int, help="[default: 0]")
@click.option("--device", help="auto | cpu | cuda | cuda:N")
@click.option("--out", "out", default="sweep", show_default=True, type=click.Path(file_okay=False),
              help="writes OUT/sweep.json, OUT/sweep.md and OUT/sweep.html")
def sweep_cmd(out: str, lrs: str | None, optimizers: str | None, precision: str | None,
              **options: Any) -> None:
    """Update sparsity and the initial Fisher's AUCs across lr x optimizer x precision: one train +
    diff per grid point."""
    options["lrs"] = _floats(lrs, "--lrs")
    options["optimizers"] = _words(optimizers)
    options["precision"] = _words(precision)
    spec = spec_from_options("sweep", options)
    _check_refs(spec)
    from compute.run_sweep import run

    with cli_progress("sweep") as progress:
        try:
            result = run(spec, progress)
        except ValueError as exc:
            fail(str(exc).splitlines()[0])
    s = result.summary
    out_dir = Path(out)
    from app.commands.experiments import _write_html, json_safe

    data = json_safe({**result.to_dict(), "points": s["points"], "spec": spec.model_dump(mode="json"),
                      "command": spec_command("sweep", spec),
                      "model_weights_sha256": _weights_sha256(spec.model)})
    write_json(out_dir / "sweep.json", data)
    (out_dir / "sweep.md").write_text(s["markdown"])
    _write_html(data, out_dir / "sweep.html")
    click.echo(s["markdown"])
    click.echo(f"{len(s['points'])} points in {s['seconds']:.0f} s; wrote {out_dir / 'sweep.json'}, "
               f"{out_dir / 'sweep.md'} and {out_dir / 'sweep.html'}")


commands: list[click.Command] = [train_cmd, sweep_cmd]
