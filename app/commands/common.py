"""Helpers shared by CLI commands: one clear error line and a non-zero exit code."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import click

from compute.specs import SpecError, parse_spec


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line to stderr and exit non-zero (no traceback for user errors)."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def spec_from_options(kind: str, options: dict[str, Any]) -> Any:
    """Validate CLI options (None = not given, use the spec default) into the job spec."""
    data = {k: v for k, v in options.items() if v is not None}
    try:
        return parse_spec(kind, data)
    except SpecError as exc:
        fail("; ".join(f"--{e['field'].replace('_', '-')}: {e['message']}" for e in exc.errors))


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    tmp.replace(path)


@contextmanager
def cli_progress(desc: str) -> Iterator[Callable[[float, str], None]]:
    """A tqdm bar on stderr driven by progress(fraction, message)."""
    from tqdm import tqdm

    bar = tqdm(total=1000, desc=desc, leave=False, bar_format="{l_bar}{bar}| {elapsed}")

    def progress(fraction: float, message: str = "") -> None:
        bar.n = int(1000 * min(max(fraction, 0.0), 1.0))
        if message:
            bar.set_postfix_str(message[:60], refresh=False)
        bar.refresh()

    try:
        yield progress
    finally:
        bar.close()
