"""Field metadata of the spec models for generators (CLI options, UI forms): type, default,
description, bounds and Literal choices, read from the pydantic model itself. Pydantic only."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

BOUND_KEYS = ("ge", "gt", "le", "lt")


@dataclass(frozen=True)
class FieldInfo:
    """One spec field as a form or CLI generator needs it (built by `describe_fields`).

    `type` is the scalar Python type (of the items when `is_list`); `choices` holds the Literal
    values; `bounds` the numeric bounds ({'ge': 1, 'le': 4096}, of the items when `is_list`);
    `min_length`/`max_length` the string length, or the list length when `is_list`."""

    name: str
    type: type
    default: Any
    required: bool
    help: str | None = None
    bounds: dict[str, Any] = dc_field(default_factory=dict)
    choices: tuple[Any, ...] | None = None
    is_list: bool = False
    optional: bool = False
    min_length: int | None = None
    max_length: int | None = None

    def range_text(self) -> str:
        """The accepted range in the words of the error messages ('>= 1, <= 4096'); '' if none."""
        ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
        return ", ".join(f"{ops[k]} {v}" for k, v in self.bounds.items())


def constraints(metadata: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in metadata:
        for k in (*BOUND_KEYS, "min_length", "max_length"):
            if getattr(m, k, None) is not None:
                out[k] = getattr(m, k)
    return out


def _unwrap(annotation: Any) -> tuple[Any, bool, dict[str, Any], str | None]:
    """(inner annotation, optional, constraints, description) of `X | None` / `Annotated[X, ...]`."""
    optional, cons, desc = False, {}, None
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(args) < len(get_args(annotation))
        annotation = args[0] if len(args) == 1 else annotation
    if get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        for e in extra:
            cons.update(constraints([*getattr(e, "metadata", []), e]))
            desc = desc or getattr(e, "description", None)
    return annotation, optional, cons, desc


def describe_fields(spec_cls: type[BaseModel]) -> list[FieldInfo]:
    """The fields of a spec model in declaration order, for generated CLI options and UI forms.

    Everything comes from the model itself (type, default, description, bounds, Literal choices),
    so a form or an option never repeats a default or a range by hand."""
    out = []
    for name, info in spec_cls.model_fields.items():
        ann, optional, cons, desc = _unwrap(info.annotation)
        cons = {**cons, **constraints(info.metadata)}
        is_list = get_origin(ann) is list
        if is_list:
            ann, _, item_cons, _ = _unwrap(get_args(ann)[0])
            cons = {**item_cons, **{k: v for k, v in cons.items() if k not in BOUND_KEYS}}
        choices = get_args(ann) if get_origin(ann) is Literal else None
        py_type = type(choices[0]) if choices else ann
        required = info.is_required()
        if required:
            default = None
        elif info.default_factory is not None:
            default = info.default_factory()  # type: ignore[call-arg]
        else:
            default = info.default
        out.append(FieldInfo(
            name=name, type=py_type, default=default, required=required,
            help=info.description or desc, bounds={k: cons[k] for k in BOUND_KEYS if k in cons},
            choices=choices, is_list=is_list, optional=optional,
            min_length=cons.get("min_length"), max_length=cons.get("max_length"),
        ))
    return out
