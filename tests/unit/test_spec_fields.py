"""describe_fields: the spec metadata that CLI options and UI forms are generated from."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from compute.contract.specs import FieldInfo, ModelRef, SpecError, describe_fields
from compute.jobs.mask import MaskSpec
from compute.jobs.registry import KINDS, parse_spec
from compute.jobs.sweep import SweepSpec
from compute.jobs.train import TrainSpec

SPECS = {name: kind.spec for name, kind in KINDS.items()}


def _by_name(cls: type) -> dict[str, FieldInfo]:
    return {f.name: f for f in describe_fields(cls)}


def test_scalar_fields_carry_type_default_bounds_help() -> None:
    f = _by_name(TrainSpec)
    assert list(f) == list(TrainSpec.model_fields)  # declaration order, every field
    assert f["steps"] == FieldInfo(name="steps", type=int, default=30, required=False,
                                   help="optimizer steps", bounds={"ge": 1, "le": 100_000})
    assert f["lr"].type is float and f["lr"].default == 2e-4
    assert f["lr"].bounds == {"gt": 0.0, "le": 10.0}
    assert f["lr"].range_text() == "> 0.0, <= 10.0"
    assert f["momentum"].bounds == {"ge": 0.0, "lt": 1.0}
    assert f["batch"].help == "prompts per step"
    assert f["bound"].type is bool and f["bound"].default is True


def test_required_optional_and_annotated_aliases() -> None:
    f = _by_name(TrainSpec)
    assert f["model"].required and f["model"].default is None and not f["model"].optional
    assert f["model"].min_length == 1 and f["model"].max_length == 500
    # `ModelRef | None`: the description and lengths come from inside the Annotated alias
    assert f["teacher"].optional and not f["teacher"].required and f["teacher"].type is str
    assert f["teacher"].help == "teacher model for opd (same tokenizer)"  # the field's own wins

    class Probe(BaseModel):
        ref: ModelRef | None = None  # no description of its own: the alias's

    (probe,) = describe_fields(Probe)
    assert probe.optional and probe.help and "zoo name" in probe.help and probe.max_length == 500
    assert f["teacher"].max_length == 500
    assert f["grad_clip"].optional and f["grad_clip"].default == 1.0
    assert f["grad_clip"].bounds == {"gt": 0.0, "le": 1e6}


def test_literal_choices() -> None:
    f = _by_name(TrainSpec)
    assert f["algo"].choices == ("grpo", "opd", "sft") and f["algo"].type is str
    assert f["mask_select"].optional and f["mask_select"].choices is not None
    assert "fisher" in f["mask_select"].choices
    assert _by_name(MaskSpec)["select"].default == "fisher"


def test_list_fields_item_bounds_and_list_length() -> None:
    f = _by_name(SweepSpec)
    lrs = f["lrs"]
    assert lrs.is_list and lrs.type is float
    assert lrs.default == [1e-6, 1e-5, 1e-4, 1e-3]  # default_factory evaluated
    assert lrs.bounds == {"gt": 0.0, "le": 10.0}  # of each item
    assert (lrs.min_length, lrs.max_length) == (1, 16)  # of the list
    assert f["optimizers"].is_list and f["optimizers"].choices == ("adamw", "sgd")


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_bounds_agree_with_validation(kind: str) -> None:
    """Every described bound is the one the model enforces: a value just past it is refused with
    the field name and the same range text."""
    cls = SPECS[kind]
    for f in describe_fields(cls):
        if f.is_list or not f.bounds or f.type not in (int, float):
            continue
        for op, edge in f.bounds.items():
            bad = edge - 1 if op == "ge" else edge + 1 if op == "le" else edge
            data = {"model": "arith-base", "base": "a", "tuned": "b", "context": "x",
                    "fisher": "job:1", "prompts": 4096, f.name: f.type(bad)}
            with pytest.raises(SpecError) as exc:
                parse_spec(kind, data)
            errs = {e["field"]: e["message"] for e in exc.value.errors}
            assert f.name in errs, (kind, f.name, errs)
            assert f.range_text() in errs[f.name]
