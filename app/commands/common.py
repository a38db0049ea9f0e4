"""Helpers shared by CLI commands: one clear error line and a non-zero exit code, spec
validation from options, running a job in-process, result files (JSON, HTML) and the command
line that reproduces a spec. Command modules import this, never each other."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import click

from compute.contract.specs import SpecError
from compute.jobs.registry import parse_spec


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line to stderr and exit non-zero (no traceback for user errors)."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def _flag_errors(exc: SpecError) -> NoReturn:
    fail("; ".join(f"--{e['field'].replace('_', '-')}: {e['message']}" for e in exc.errors))


def spec_from_options(kind: str, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(spec, refs): CLI options (None = not given, use the spec default) validated into the job
    spec through the same checks as a submitted job (app.services.check_spec), its references
    resolved by the same resolver (app.services.refs: zoo names, folders, hub ids, job:N with
    its owner, files). Run as its user, a direct command may read any file and any model folder
    named on its command line (never a path inside the artifact store: write job:N). Exit 2
    naming the flag otherwise. Pass both to `run_job`."""
    data = {k: v for k, v in options.items() if v is not None}
    try:
        spec = parse_spec(kind, data)
    except SpecError as exc:
        _flag_errors(exc)
    from app import auth, services
    from compute.contract.settings import get_settings

    settings = get_settings()
    try:
        _, refs = services.check_spec(settings, kind, spec, local=True,
                                      user=auth.optional_user(settings))
    except SpecError as exc:
        _flag_errors(exc)
    return spec, refs


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


def run_job(kind: str, spec: Any, refs: dict[str, Any], desc: str | None = None) -> Any:
    """Run the job in this process (the entry point the worker calls) with a progress bar and
    the refs spec_from_options resolved; a ValueError from the job is the user's error: one
    line, exit 2."""
    from compute.jobs.runners import get_runner

    try:
        with cli_progress(desc or kind) as progress:
            return get_runner(kind)(spec, progress, refs=refs)
    except ValueError as exc:
        fail(" ".join(str(exc).split()))


def json_safe(obj: Any) -> Any:
    """NaN/inf -> None (strict JSON), recursively (storage's copy, imported when first used)."""
    from storage.serialize import json_safe as _json_safe

    return _json_safe(obj)


def write_html(result: dict[str, Any], path: Path) -> None:
    """All figures of the result in one self-contained HTML file (skipped if plotting fails)."""
    try:
        from app.plots import result_figures

        figs = result_figures(result)
        parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, (_, fig) in enumerate(figs)]
    except Exception as exc:  # noqa: BLE001 - the JSON is the result; the HTML is a convenience
        click.echo(f"(no HTML figures: {type(exc).__name__}: {exc})", err=True)
        return
    path.write_text("<html><head><meta charset='utf-8'></head><body>" + "\n".join(parts) + "</body></html>")


def spec_command(kind: str, spec: Any, **extra: str) -> str:
    """The shortest `fisherlens KIND --flag value ...` that makes `spec`: a flag for each field
    the spec would not get without it (so a value derived from another field, like retention's
    eval_prompts from eval_se, is left out), in field order; then `extra` flags (e.g. out)."""
    import shlex

    cls = type(spec)
    values = spec.model_dump(mode="json")
    given = {}
    for name, info in cls.model_fields.items():
        default = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
        if info.is_required() or values[name] != default:
            given[name] = values[name]
    for name in list(given):
        rest = {k: v for k, v in given.items() if k != name}
        try:
            if getattr(cls.model_validate(rest), name) == getattr(spec, name):
                given = rest
        except ValueError:  # needed (a required field, or another field's rule)
            pass
    parts = ["fisherlens", kind]
    for name, v in given.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(v, bool):
            parts.append(flag if v else "--no-" + flag[2:])
            continue
        text = ",".join(_num(x) for x in v) if isinstance(v, list) else _num(v)
        parts += [flag, text]
    for k, v in extra.items():
        parts += [f"--{k}", v]
    return shlex.join(parts)


def _num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def table_text(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table, columns as wide as their widest cell."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in cells)


def report(result: Any) -> None:
    """Print a result's key numbers exactly as the browser and its share page show them
    (app.figures.keynumbers: the kind's builder, the headline precision policy, the labels of
    what holds by construction, the verdict and its thresholds, the SE beside every accuracy), so
    the CLI cannot state a number more strongly than the pages do. The full summary is in the
    command's JSON file."""
    from app.figures.keynumbers import key_numbers

    kn = key_numbers(json_safe(result.to_dict()))
    verdict = kn.get("verdict")
    if verdict and verdict.get("level") not in (None, "none"):
        text = str(verdict.get("text") or "")
        click.echo("verdict: " + (text if verdict["level"] in text else f"{verdict['level']}: {text}".rstrip(": ")))
    for it in kn["items"]:
        click.echo(f"{it['label']}: {it['value']}" + (f" ({it['note']})" if it.get("note") else ""))
    for w in kn["warnings"]:
        click.echo(f"warning: {w}")
    table = kn.get("table")
    if table and table.get("rows"):
        click.echo(table.get("title") or "")
        click.echo(table_text(list(table["headers"]), [list(r) for r in table["rows"]]))
