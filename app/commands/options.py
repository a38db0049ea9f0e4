"""Click options generated from a spec model's fields (compute.contract.specs.describe_fields).

One list of fields, in the spec: the flag (`max_new_tokens` -> `--max-new-tokens`), the help
text, the default and the accepted range shown in `--help` all come from it. Values are not
checked by click: every option defaults to None ("not given, use the spec's default") and the
spec validates them, so a bad value fails with the spec's message (field and accepted range)
through `spec_from_options`. List fields take comma-separated values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import click

from app.commands.common import fail
from compute.contract.specs import FieldInfo, describe_fields

F = TypeVar("F", bound=Callable[..., Any])


def flag(name: str) -> str:
    """The CLI flag of a spec field."""
    return "--" + name.replace("_", "-")


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(_show(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def option_help(info: FieldInfo, help: str | None = None, default_text: str | None = None) -> str:
    """`description  [choices; default; range]`, e.g. 'prompts per step  [default: 8; range: >= 1, <= 1024]'."""
    notes = []
    if info.choices:
        notes.append((", ".join if info.is_list else " | ".join)(map(str, info.choices)))
    if default_text is None and info.default is not None and not info.required:
        default_text = _show(info.default)
    if default_text:
        notes.append(f"default: {default_text}")
    if info.bounds:
        notes.append(f"range: {info.range_text()}")
    text = help if help is not None else (info.help or "")
    if info.is_list:
        text = f"comma-separated; {text}" if text else "comma-separated"
    return f"{text}  [{'; '.join(notes)}]" if notes else text


def _list_callback(info: FieldInfo) -> Callable[[click.Context, click.Parameter, str | None], Any]:
    """Comma-separated text -> a list of the field's item type (the spec checks the items)."""

    def parse(ctx: click.Context, param: click.Parameter, text: str | None) -> list[Any] | None:
        if text is None:
            return None
        items = [x.strip() for x in text.split(",") if x.strip()]
        if info.type in (int, float):
            try:
                return [info.type(x) for x in items]
            except ValueError:
                rng = f" {info.range_text()}" if info.bounds else ""
                fail(f"{flag(info.name)}: got {text!r}; expected comma-separated numbers{rng}, e.g. "
                     f"{_show(info.default) if info.default else '1,2'}")
        return items

    return parse


def click_option(info: FieldInfo, **override: Any) -> Callable[[F], F]:
    """The click option of one spec field; `override` may set `help` (the description part),
    `default_text` ('' hides the default) or any click.option keyword."""
    help_text = option_help(info, override.pop("help", None), override.pop("default_text", None))
    kwargs: dict[str, Any] = {"default": None, "help": help_text}
    decls = [flag(info.name)]
    if info.is_list:
        kwargs["callback"] = _list_callback(info)
    elif info.type is bool:
        decls = [f"{flag(info.name)}/--no-{flag(info.name)[2:]}"]
    elif info.type in (int, float):
        kwargs["type"] = info.type
    if info.required:
        kwargs["required"] = True
    kwargs.update(override)
    return click.option(*decls, info.name, **kwargs)


def spec_options(spec_cls: type, *, exclude: Iterable[str] = (),
                 overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Callable[[F], F]:
    """Decorator adding one option per field of `spec_cls` (declaration order), except `exclude`
    (e.g. fields given as arguments). The command receives each as a keyword, None when not given:
    pass them to `spec_from_options(kind, options)`."""
    skip = set(exclude)
    overrides = overrides or {}
    fields = [f for f in describe_fields(spec_cls) if f.name not in skip]
    unknown = (set(overrides) | skip) - {f.name for f in describe_fields(spec_cls)}
    if unknown:
        raise ValueError(f"spec_options: {spec_cls.__name__} has no field(s) {sorted(unknown)}")

    def decorate(f: F) -> F:
        for info in reversed(fields):  # click lists options in the reverse order of application
            f = click_option(info, **dict(overrides.get(info.name, {})))(f)
        return f

    return decorate
