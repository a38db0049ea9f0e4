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


def _flag_errors(exc: SpecError) -> NoReturn:
    fail("; ".join(f"--{e['field'].replace('_', '-')}: {e['message']}" for e in exc.errors))


def spec_from_options(kind: str, options: dict[str, Any]) -> Any:
    """Validate CLI options (None = not given, use the spec default) into the job spec, through
    the same checks as a submitted job (app.services.check_spec): model and job:N references,
    layer ranges, artifact and jsonl files. Run as its user, a direct command may read any
    file and any model folder named on its command line. Exit 2 naming the flag otherwise."""
    data = {k: v for k, v in options.items() if v is not None}
    try:
        spec = parse_spec(kind, data)
    except SpecError as exc:
        _flag_errors(exc)
    from app import services
    from compute.contract.settings import get_settings
    from compute.modelref import MODEL_FIELDS

    _allow_local_dirs(*(getattr(spec, f, None) for f in MODEL_FIELDS))
    try:
        services.check_spec(get_settings(), kind, spec, local=True)
    except SpecError as exc:
        _flag_errors(exc)
    return spec


def _allow_local_dirs(*refs: str | None) -> None:
    """Model folders named on the command line (e.g. a training output) are allowed for this
    process (ALLOWED_MODEL_ROOTS); jobs from the web stay restricted to the operator's roots."""
    import os

    extra = []
    for r in refs:
        if r and not r.startswith("job:"):
            try:
                if Path(r).expanduser().is_dir():
                    extra.append(str(Path(r).expanduser().resolve()))
            except OSError:
                continue
    if extra:
        current = os.environ.get("ALLOWED_MODEL_ROOTS", "")
        os.environ["ALLOWED_MODEL_ROOTS"] = ":".join(p for p in [current, *extra] if p)


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
