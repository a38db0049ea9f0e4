"""`fisherlens zoo build|list`: fisherlens' own tiny models (torch imported lazily)."""

from __future__ import annotations

import click

from app.commands.common import fail


@click.group()
def zoo() -> None:
    """Build and list the zoo: tiny local models (arith-base, arith-teacher), no network needed."""


@zoo.command("build")
@click.option("--names", default=None, help="Comma-separated zoo names (default: all).")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(0, 2**31 - 1),
    help="Seed for initialisation and training data.",
)
@click.option("--force", is_flag=True, help="Rebuild models that are already built.")
def build(names: str | None, seed: int, force: bool) -> None:
    """Build the zoo models under $FISHERLENS_HOME/zoo (deterministic given --seed)."""
    from app.settings import get_settings
    from compute.modelref import ZOO_NAMES

    selected = [n.strip() for n in names.split(",") if n.strip()] if names else list(ZOO_NAMES)
    for n in selected:
        if n not in ZOO_NAMES:
            fail(f"--names: unknown zoo model {n!r}; accepted: {', '.join(ZOO_NAMES)}")
    if not selected:
        fail(f"--names: empty list; accepted: {', '.join(ZOO_NAMES)}")

    from tqdm import tqdm

    from compute.zoo import build_zoo

    zoo_dir = get_settings().zoo_dir
    with tqdm(total=100, desc="zoo build", unit="%", leave=False) as bar:

        def progress(fraction: float, message: str) -> None:
            bar.n = round(100 * fraction)
            bar.set_postfix_str(message[:60])
            bar.refresh()

        infos = build_zoo(zoo_dir, names=selected, progress=progress, seed=seed, force=force)
    for info in infos:
        click.echo(
            f"{info['name']}: {info['params']:,} params, accuracy {info['accuracy']:.1%} "
            f"({info['accuracy_prompts']} test prompts, greedy), {info['build_seconds']:.0f}s, "
            f"{zoo_dir / info['name']}"
        )


@zoo.command("list")
def list_() -> None:
    """Show the zoo models: name, params, held-out accuracy, path."""
    from app.settings import get_settings
    from compute.zoo import zoo_list

    rows = zoo_list(get_settings().zoo_dir)
    click.echo(f"{'name':<15} {'params':>9} {'accuracy':>9}  path")
    for r in rows:
        params = f"{r['params']:,}" if r["built"] else "-"
        acc = f"{r['accuracy']:.1%}" if r["built"] else "not built"
        click.echo(f"{r['name']:<15} {params:>9} {acc:>9}  {r['path']}")


commands: list[click.Command] = [zoo]
