"""A job kind is one module (compute/jobs/<kind>.py) plus its figures (app/figures/<kind>.py), and
every layer iterates compute.jobs.registry: no product file lists kinds or branches on a kind.

The list check reads the source with `ast` (nothing imported): a collection literal (tuple, list,
set, dict keys) holding two or more job-kind names as strings, or a comparison of something named
`kind` (`kind == "x"`, `job.kind in (...)`) with a kind-name string, is a kind list or an if-chain.
Allowed: compute/jobs/ (the kinds themselves), app/figures/<kind>.py (registered by kind), and
ALLOWED below, each entry with the reason its strings are not job kinds.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import click
import pytest

from compute.contract.kinds import JobKind
from compute.contract.results import Contract
from compute.contract.specs import Spec, SpecError
from compute.jobs import registry

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("app", "compute", "storage")

# file -> why its kind-name strings are not job kinds (keep this short)
ALLOWED = {
    # "fisher" / "mask" here are reference targets (what a field names: a file of per-parameter
    # tensors), which the kinds' `refs` / `outputs` use; not a list of job kinds
    "compute/contract/kinds.py": "RefTarget: the targets a reference field names",
    # artifact file stems (fisher.safetensors, mask.safetensors) skipped when looking for weights
    "compute/sparsity/diff.py": "artifact file names next to a checkpoint",
}


def _is_kind_figures(rel: str) -> bool:
    return rel.startswith("app/figures/") and Path(rel).stem in registry.KINDS


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _names_kind(node: ast.AST) -> bool:
    """`kind`, `job.kind`, `self.kind`, `job_kind`, ...: an expression that holds a job kind."""
    ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return ident == "kind" or ident.endswith("_kind")


def kind_lists(source: str, kinds: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every kind list or kind if-chain in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in kinds}
            if len(items) >= 2:
                found.append((node.lineno, f"kind list {sorted(items)}"))
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in kinds}
            if len(keys) >= 2:
                found.append((node.lineno, f"dict keyed by kinds {sorted(keys)}"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_kind(s) for s in sides):
                named = sorted({s for side in sides for s in _strings(side) if s in kinds})
                if named:
                    found.append((node.lineno, f"branch on kind {named}"))
    return found


def test_the_list_check_sees_lists_and_branches() -> None:
    kinds = {"fisher", "mask", "diff"}
    src = ('A = ("fisher", "mask")\nB = {"diff": 1, "mask": 2}\nif kind == "diff": pass\n'
           'if job.kind in ("fisher",): pass\nC = ("fisher", "other")\nif select == "fisher": pass\n')
    assert [line for line, _ in kind_lists(src, kinds)] == [1, 2, 3, 4]


def test_no_product_file_lists_kinds_or_branches_on_one() -> None:
    kinds = set(registry.KINDS)
    bad = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("compute/jobs/") or _is_kind_figures(rel) or rel in ALLOWED:
                continue
            bad += [f"{rel}:{line}: {what}" for line, what in kind_lists(path.read_text(), kinds)]
    assert bad == [], "iterate compute.jobs.registry instead:\n" + "\n".join(bad)


def test_allowed_files_still_need_their_entry() -> None:
    """An allow-list entry whose file no longer lists kinds is stale: remove it."""
    kinds = set(registry.KINDS)
    stale = [rel for rel in ALLOWED if not kind_lists((ROOT / rel).read_text(), kinds)]
    assert stale == []


@pytest.mark.parametrize("name", registry.NAMES)
def test_every_kind_is_complete(name: str) -> None:
    kind = registry.get(name)
    assert isinstance(kind, JobKind) and kind.name == name and kind.title.strip()
    assert issubclass(kind.spec, Spec) and isinstance(kind.contract, Contract)
    module, _, function = kind.runner.partition(":")
    assert importlib.util.find_spec(module) is not None, kind.runner  # found, not imported (torch)
    spec = registry.parse_spec(name, dict(kind.example))  # a valid example, priced
    passes = kind.cost(spec)
    assert isinstance(passes, int) and passes >= 0
    # figures: a module registered by kind, with figures or tables, and key numbers
    from app.figures.registry import entries, figure_module, key_numbers_builder, table_entries

    assert importlib.util.find_spec(figure_module(name)) is not None
    own = [e for e in (*entries(name), *table_entries(name)) if e.kind == name]
    assert own, f"app/figures/{name}.py registers no figure or table"
    assert key_numbers_builder(name) is not None, f"app/figures/{name}.py registers no key numbers"


def test_lookups_name_the_accepted_kinds() -> None:
    accepted = ", ".join(registry.NAMES)
    with pytest.raises(ValueError, match=f"unknown job kind 'nope'; accepted: {accepted}$"):
        registry.get("nope")
    with pytest.raises(SpecError) as exc:
        registry.parse_spec("nope", {})
    assert exc.value.errors[0]["field"] == "kind" and accepted in exc.value.errors[0]["message"]


def test_a_kind_without_cost_or_with_a_wrong_form_is_refused() -> None:
    fisher = registry.get("fisher")
    with pytest.raises(TypeError):  # cost is a required field of JobKind
        JobKind(name="x", title="X", spec=fisher.spec, contract=fisher.contract, runner="m:f")  # type: ignore[call-arg]
    from dataclasses import replace

    from compute.contract.kinds import KindForm

    for bad, match in (
        (replace(fisher, cost=None), "cost is missing"),
        (replace(fisher, form=KindForm("F", "Go", ("no_such_field",))), "no_such_field"),
        (replace(fisher, refs={"model": "nothing"}), "refs"),
        (replace(fisher, runner="compute.jobs.fisher_run"), "module:function"),
        (replace(fisher, name="other"), "module's name"),
        (replace(fisher, memory_options=({"no_such_field": 1},)), "memory_options name 'no_such_field'"),
        (replace(fisher, memory_options=({"dtype": "float7"},)), r"memory_options\['dtype'\] = 'float7'"),
        (replace(fisher, memory=None), "memory_options without memory"),
    ):
        with pytest.raises(registry.RegistryError, match=match):
            registry._check_kind(bad, "fisher")


def test_every_layer_offers_every_kind() -> None:
    from fastapi import FastAPI

    from app.api import JobRequest, make_router
    from app.cli import main
    from app.render import title as page_title  # the share page and the result tab
    from app.ui.formtab import form_defs
    from compute.jobs.runners import RUNNERS

    names = list(registry.NAMES)
    assert JobRequest.model_json_schema()["properties"]["kind"]["enum"] == names
    app = FastAPI()
    app.include_router(make_router(None))
    params = app.openapi()["paths"]["/api/jobs"]["get"]["parameters"]
    kind_param = next(p for p in params if p["name"] == "kind")
    assert names in [s.get("enum") for s in kind_param["schema"].get("anyOf", [kind_param["schema"]])]
    assert isinstance(main, click.Group) and set(names) <= set(main.commands)
    assert set(RUNNERS) == set(names)
    assert [d.kind for d in form_defs()] == [n for n in names if registry.get(n).form is not None]
    for n in names:  # sweep had no title on the share page before the registry
        assert page_title({"kind": n, "id": 3}) == f"{registry.get(n).title} result #3"


def test_the_generic_command_runs_options_from_the_spec() -> None:
    """A kind without its own command gets one: options generated from its spec, cli_args as
    arguments (shown with the diff kind, which has both)."""
    from app.commands.kinds import generic_command

    cmd = generic_command(registry.get("diff"))
    params = {p.name: p for p in cmd.params}
    assert [p.name for p in cmd.params if isinstance(p, click.Argument)] == ["base", "tuned"]
    assert {"out", "fisher", "topk_percent", "store_delta"} <= set(params)
    from click.testing import CliRunner

    res = CliRunner().invoke(cmd, ["a", "b", "--topk-percent", "500", "--out", "x"])
    assert res.exit_code == 2 and "--topk-percent" in res.output and "<= 100" in res.output
