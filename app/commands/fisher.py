"""`fisherlens fisher`: estimate the diagonal Fisher of a model on a task, write it and its stats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from app.commands.common import run_job, spec_from_options, write_json
from app.commands.options import spec_options
from compute.jobs.fisher import FisherSpec


def _summary_table(result: Any) -> str:
    """One line per layer: share of Fisher mass, mean, and the module type holding most mass
    (compute.lm.cells.aggregate of the layer x module rows; the rows outside the blocks named)."""
    from app.figures.labels import layer_name
    from compute.lm.cells import aggregate

    rows = [s for s in result.layer_stats if s.group == "layer_module"]
    by_layer = aggregate(rows, by=("layer",))
    w = max([5, *(len(layer_name(k[0])) for k in by_layer)])
    lines = [f"{'layer':<{w}} {'params':>10} {'share':>7} {'mean':>11}  top module (share)"]
    for (layer,), r in by_layer.items():
        top = max((s for s in rows if s.layer == layer), key=lambda s: s.values["share"])
        lines.append(f"{layer_name(layer):<{w}} {int(r['numel']):>10,} {r['share']:>7.1%} {r['mean']:>11.4g}  "
                     f"{top.module} ({top.values['share']:.1%})")
    return "\n".join(lines)


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
    s = result.summary
    click.echo(_summary_table(result))
    stab = s.get("split_half_jaccard")
    stab_txt = f"{stab:.3f}" if stab is not None else "n/a"
    click.echo(
        f"{s['estimator']} Fisher of {spec.model} on {spec.task}: {s['n_samples']} samples "
        f"({s['n_rows']} sequences, {s['n_tokens']} tokens), gini {s['gini']:.3f}, "
        f"top 1% holds {s['top1%_share']:.1%} of the mass, split-half top-{spec.topk_percent:g}% "
        f"Jaccard {stab_txt}"
    )
    from compute.contract.results import reliability_level

    level = reliability_level(stab)
    click.echo(f"reliability: {level} (split-half Jaccard {stab_txt}; fair >= 0.5, good >= 0.8)"
               + ("; rerun with --until-reliable for more samples" if level == "poor" else ""))
    rounds = s.get("until_reliable")
    if rounds:
        click.echo("until_reliable: " + " -> ".join(f"{r['prompts']} prompts ({r['split_half_jaccard']:.3f})"
                                                    for r in rounds["rounds"]) + f"; {rounds['note']}")
    perr = s.get("precision_error")
    if perr:
        click.echo(f"precision: computed in {s.get('compute_dtype')}; relative L1 error {perr['relative_l1']:.3g} "
                   f"against float32 on the first {perr['rows']} completions (worst tensor "
                   f"{perr['worst_tensor_relative_l1']:.3g})")
    for name, e in (s.get("exact_output") or {}).items():
        click.echo(f"exact output-layer check ({name}): relative L1 error "
                   f"{e['relative_l1_error']:.3f}")
    click.echo(f"wrote {out_dir / 'fisher.safetensors'} and {out_dir / 'stats.json'}")


commands = [fisher]
