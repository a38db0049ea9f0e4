"""Job form fields generated from the spec models (compute/contract/specs.py), so the form, the CLI and the
spec never disagree on a default, a range or a choice.

`describe(kind, name)` reads the spec's field metadata (compute.contract.specs.describe_fields: type,
default, description, ge/gt/le/lt bounds, Literal choices, as the CLI options do); `component(...)` maps it to a Gradio input with the label,
the help text and the accepted range; `form_data(kind, names, values)` turns the submitted values
back into a spec dict. Validation stays in one place: `services.submit` -> `parse_spec`, whose
errors name the field and its accepted range.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import gradio as gr

from compute.contract.spec_fields import FieldInfo
from compute.contract.specs import SpecError, describe_fields
from compute.jobs import registry

Widget = Literal["int", "float", "bool", "choice", "choices", "floats", "text"]
NONE_LABEL = "(none)"  # the blank choice of an optional dropdown; submitted as "" (= the default)


@dataclass(frozen=True)
class FieldDesc:
    """One spec field as a form shows it."""

    kind: str  # job kind (fisher, train, ...)
    name: str
    widget: Widget
    default: Any
    help: str
    source: FieldInfo  # what compute.contract.specs.describe_fields says about it
    choices: tuple[str, ...]
    optional: bool  # None is accepted (blank means "not given")

    @property
    def label(self) -> str:
        return self.name.replace("_", " ")

    @property
    def range_text(self) -> str:
        """'accepted: >= 1, <= 4096' from the declared bounds ('' when unbounded)."""
        text = self.source.range_text()
        return f"accepted: {text}" if text else ""

    @property
    def info(self) -> str:
        parts = [self.help, self.range_text]
        if self.widget == "floats":
            parts.append("numbers separated by commas")
        return "; ".join(p for p in parts if p)


def _widget(f: FieldInfo) -> Widget:
    if f.choices:
        return "choices" if f.is_list else "choice"
    if f.is_list:
        return "floats"
    return {bool: "bool", int: "int", float: "float"}.get(f.type, "text")  # type: ignore[return-value]


@functools.cache
def _fields(kind: str) -> dict[str, FieldInfo]:
    return {f.name: f for f in describe_fields(registry.get(kind).spec)}


def describe(kind: str, name: str) -> FieldDesc:
    """The form description of field `name` of job `kind`'s spec (compute.contract.specs.describe_fields:
    the same metadata the CLI options are generated from)."""
    f = _fields(kind)[name]
    return FieldDesc(kind=kind, name=name, widget=_widget(f), default=f.default, help=f.help or "",
                     source=f, choices=tuple(str(c) for c in f.choices or ()),
                     optional=f.optional)


def all_fields(kind: str) -> list[str]:
    return list(_fields(kind))


def component(d: FieldDesc, *, blank: bool = False, value: Any = None, **kw: Any) -> gr.components.Component:
    """A Gradio input for `d`, labelled with the field name, its help and its accepted range.
    `blank`: start empty so the spec default applies (the "advanced" fields); `value`: a starting
    value other than the default; `kw` overrides (label, elem_id, ...)."""
    if value is None:
        value = None if blank else d.default
    kw = {"label": d.label, "info": d.info, "elem_id": f"{d.kind}-{d.name.replace('_', '-')}", **kw}
    if d.widget in ("int", "float") and value is None:
        # a blank number is text: a mounted gr.Number sends 0 for "empty", which is not "the default"
        hint = "blank = none" if d.default is None else f"blank = {d.default}"
        return gr.Textbox("", placeholder=hint, **kw)
    if d.widget in ("int", "float"):
        # no precision: a fraction for an int field reaches the spec check (never rounded)
        return gr.Number(value, **kw)
    if d.widget == "bool":
        return gr.Checkbox(bool(value if value is not None else d.default), **kw)
    if d.widget == "choice":
        choices: list[Any] = list(d.choices)
        if d.optional:
            choices = [(NONE_LABEL, ""), *choices]
        elif value is None:  # a literal default is harmless to show and submit
            value = d.default
        return gr.Dropdown(choices, value="" if value is None else value, **kw)
    if d.widget == "choices":
        return gr.CheckboxGroup(list(d.choices), value=list(value or []), **kw)
    if d.widget == "floats":
        text = ",".join(f"{x:g}" for x in value) if isinstance(value, list) else (value or "")
        return gr.Textbox(text, **kw)
    return gr.Textbox("" if value is None else str(value), **kw)


# ---------------------------------------------------------------- submitted values -> spec dict


def parse_float_list(text: str | None, field: str) -> list[float] | None:
    """'0.01, 0.05;0.1' -> [0.01, 0.05, 0.1]; blank -> None; SpecError naming `field` otherwise."""
    if text is None or not str(text).strip():
        return None
    try:
        return [float(x) for x in str(text).replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise SpecError([{"field": field, "message": f"got {text!r}; give numbers separated by commas, "
                                                      "e.g. 0.01,0.05,0.1"}]) from None


def opt_number(text: Any, field: str, integer: bool = False) -> int | float | None:
    """Blank -> None (the spec default); else the number; SpecError naming `field` otherwise."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise SpecError([{"field": field, "message": f"got {text!r}; give a number or leave it blank"}]) from None
    if integer:
        if not value.is_integer():
            raise SpecError([{"field": field, "message": f"got {text!r}; give a whole number or leave it blank"}])
        return int(value)
    return value


def _is_int_field(name: str) -> bool:
    for k in registry.KINDS.values():
        f = k.spec.model_fields.get(name)
        if f is not None and "int" in str(f.annotation) and "float" not in str(f.annotation):
            return True
    return False


def clean_spec(values: dict[str, Any]) -> dict[str, Any]:
    """Drop blanks (None, "", []) so spec defaults apply; whole floats for int fields become ints
    (pydantic rejects 1.5 for an int with a clear message, and accepts 2.0)."""
    out = {}
    for k, v in values.items():
        if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            continue
        if isinstance(v, float) and v.is_integer() and _is_int_field(k):
            v = int(v)
        out[k] = v.strip() if isinstance(v, str) else v
    return out


def form_data(kind: str, names: list[str], values: tuple[Any, ...] | list[Any]) -> dict[str, Any]:
    """The spec dict of a submitted form (`names[i]` holds `values[i]`): comma lists parsed,
    blanks dropped. Raises SpecError (naming the field) for text that is not a number (list)."""
    data: dict[str, Any] = {}
    for name, value in zip(names, values, strict=True):
        widget = describe(kind, name).widget
        if widget == "floats":
            value = parse_float_list(value, name)
        elif widget in ("int", "float") and isinstance(value, str):  # a blank-able number box
            value = opt_number(value, name, integer=widget == "int")
        data[name] = value
    return clean_spec(data)


def range_info(kind: str, field: str) -> str:
    """'accepted: >= 1, <= 4096' style hint from the spec's declared bounds."""
    return describe(kind, field).range_text
