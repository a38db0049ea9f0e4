"""CLI options generated from the spec models (app/commands/options.py) and the command line that
reproduces a spec (common.spec_command)."""

from __future__ import annotations

import shlex

import click
import pytest
from click.testing import CliRunner

from app.cli import main
from app.commands.common import spec_command
from app.commands.options import flag, spec_options
from compute.contract.specs import describe_fields
from compute.jobs.registry import KINDS, parse_spec
from compute.jobs.retention import RetentionSpec
from compute.jobs.sweep import SweepSpec
from compute.jobs.train import TrainSpec

SPECS = {name: kind.spec for name, kind in KINDS.items()}

# command -> (spec kind, fields given as arguments instead of options)
COMMANDS = {"fisher": ("fisher", ()), "mask": ("mask", ()), "train": ("train", ()), "sweep": ("sweep", ()),
            "retention": ("retention", ()), "diff": ("diff", ("base", "tuned")), "tokens": ("tokens", ())}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_spec_field_is_an_option_with_its_default_and_range(name: str) -> None:
    kind, args = COMMANDS[name]
    cmd = main.commands[name]
    opts = {p.name: p for p in cmd.params if isinstance(p, click.Option)}
    for f in describe_fields(SPECS[kind]):
        if f.name in args:
            assert f.name in {p.name for p in cmd.params if isinstance(p, click.Argument)}
            continue
        opt = opts[f.name]
        assert flag(f.name) in opt.opts
        assert opt.default is None  # not given = the spec's default, never a second copy
        help_text = opt.help or ""
        if f.bounds:
            assert f"range: {f.range_text()}" in help_text, (name, f.name, help_text)
        if f.default is not None and not f.is_list and f.name != "eval_prompts":
            shown = f"{f.default:g}" if isinstance(f.default, float) else str(f.default)
            assert f"default: {shown}" in help_text, (name, f.name, help_text)
        if f.choices and not f.is_list:
            assert " | ".join(map(str, f.choices)) in help_text


def test_out_of_range_names_the_flag_and_both_ends(tmp_path) -> None:
    r = CliRunner().invoke(main, ["train", "--model", "arith-base", "--steps", "0", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert r.output.strip() == "error: --steps: got 0; accepted range: >= 1, <= 100000"


def test_list_option_parses_commas_and_refuses_non_numbers() -> None:
    seen = {}

    @click.command()
    @spec_options(SweepSpec, exclude=("model",))
    def cmd(**options: object) -> None:
        seen.update(options)

    r = CliRunner().invoke(cmd, ["--lrs", "1e-3, 0.1", "--optimizers", "sgd"])
    assert r.exit_code == 0, r.output
    assert seen["lrs"] == [1e-3, 0.1] and seen["optimizers"] == ["sgd"] and seen["precision"] is None
    r = CliRunner().invoke(cmd, ["--lrs", "1e-3,x"])
    assert r.exit_code == 2 and r.output.strip().startswith("error: --lrs: got '1e-3,x'; expected comma")
    assert "> 0.0, <= 10.0" in r.output


def test_unknown_field_in_exclude_or_overrides_is_refused() -> None:
    with pytest.raises(ValueError, match="no field"):
        spec_options(TrainSpec, exclude=("nope",))


@pytest.mark.parametrize("kind,data", [
    ("train", {"model": "arith-base", "lr": 1e-3, "bound": False, "mask_select": "fisher", "mask_density": 0.1}),
    ("sweep", {"model": "arith-base", "lrs": [1e-6, 0.01], "precision": ["fp32", "bf16"]}),
    ("retention", {"seeds": 1, "eval_se": 0.05, "densities": [0.05]}),
])
def test_spec_command_parses_back_to_the_same_spec(kind: str, data: dict) -> None:
    spec = parse_spec(kind, data)
    line = spec_command(kind, spec)
    words = shlex.split(line)
    assert words[:2] == ["fisherlens", kind]
    ctx = main.commands[kind].make_context(kind, [*words[2:], "--out", "x"])
    options = {k: v for k, v in ctx.params.items() if k not in ("out", "dry_run", "yes") and v is not None}
    assert parse_spec(kind, options) == spec


def test_spec_command_leaves_out_defaults_and_derived_values() -> None:
    spec = RetentionSpec(eval_se=0.05, seeds=1)
    assert spec.eval_prompts == 100  # derived from eval_se, so not on the command line
    assert spec_command("retention", spec) == "fisherlens retention --seeds 1 --eval-se 0.05"
    assert spec_command("train", TrainSpec(model="arith-base", bound=False)) == (
        "fisherlens train --model arith-base --no-bound")
