"""KINDS: every job kind, discovered from this folder. The only list of kinds anywhere.

Each module `compute/jobs/<kind>.py` (other than this one and private `_*.py`) declares
`KIND = JobKind(...)` (compute/contract/kinds.py). The API's kind enum, the CLI commands, the UI's
New job tabs, the share page titles, app/limits.py's costs, compute/jobs/runners.py and the worker all
iterate `KINDS` or look a kind up with `get`. A kind that is incomplete (no cost, a form naming a
field its spec lacks, ...) is a `RegistryError` when this module is imported, so the test suite
(tests/unit/test_registry.py) fails rather than a user's submission.

Pure: pydantic and compute.contract only (the web process imports it; no torch, no database).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any, get_args

from compute.contract.kinds import JobKind, RefTarget
from compute.contract.results import (
    Contract,
    ContractError,
    TypedResult,
    check_against,
    parse_with,
    result_kind,
)
from compute.contract.specs import Spec, SpecError, validate_spec


class RegistryError(TypeError):
    """A kind module that does not declare a complete KIND (the message names module and field)."""


def _check_kind(kind: JobKind, module: str) -> None:
    where = f"compute/jobs/{module}.py: KIND"

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise RegistryError(f"{where}.{what}")

    need(kind.name == module, f"name is {kind.name!r}; it must be the module's name {module!r}")
    need(bool(kind.title.strip()), "title is empty")
    need(isinstance(kind.spec, type) and issubclass(kind.spec, Spec),
         "spec must be a compute.contract.specs.Spec subclass")
    need(isinstance(kind.contract, Contract) and kind.contract.kind == kind.name,
         f"contract must be a Contract of kind {kind.name!r}")
    declared = get_args(kind.contract.result.model_fields["kind"].annotation)
    need(declared == (kind.name,), f"contract.result's kind must be Literal[{kind.name!r}]")
    mod, _, fn = kind.runner.partition(":")
    need(bool(mod and fn), f"runner is {kind.runner!r}; write 'module:function'")
    need(callable(kind.cost), "cost is missing: every kind estimates its token-passes")
    fields = kind.spec.model_fields
    targets = get_args(RefTarget)
    for f, t in kind.refs.items():
        need(f in fields, f"refs names {f!r}, which {kind.spec.__name__} does not have")
        need(t in targets, f"refs[{f!r}] is {t!r}; accepted: {', '.join(targets)}")
    for t in kind.outputs:
        need(t in targets, f"outputs has {t!r}; accepted: {', '.join(targets)}")
    for f in (*(kind.form.main if kind.form else ()), *kind.cli_args):
        need(f in fields, f"form/cli_args name {f!r}, which {kind.spec.__name__} does not have")
    need(not kind.memory_options or kind.memory is not None, "memory_options without memory: nothing prices them")
    for change in kind.memory_options:
        for f, v in change.items():
            need(f in fields, f"memory_options name {f!r}, which {kind.spec.__name__} does not have")
            try:
                kind.spec.model_validate({**kind.example, f: v})
            except ValueError as exc:
                need(False, f"memory_options[{f!r}] = {v!r} is not a valid value: {exc}")


# compute/jobs/ modules that are not a kind: this registry, the dispatch from a kind to its runner
# (runners.py) and the runners' shared reading of references (artifact_files.py, torch).
NOT_KINDS = frozenset({"registry", "runners", "artifact_files"})


def _discover() -> dict[str, JobKind]:
    import compute.jobs as package

    found: list[JobKind] = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name in NOT_KINDS or info.name.startswith("_") or info.name.endswith("_run"):
            continue  # <kind>_run.py: the kind's runner (torch), imported only when a job runs
        module = importlib.import_module(f"compute.jobs.{info.name}")
        kind = getattr(module, "KIND", None)
        if not isinstance(kind, JobKind):
            raise RegistryError(f"compute/jobs/{info.name}.py declares no KIND = JobKind(...)")
        _check_kind(kind, info.name)
        found.append(kind)
    return {k.name: k for k in sorted(found, key=lambda k: (k.order, k.name))}


KINDS: Mapping[str, JobKind] = _discover()
NAMES: tuple[str, ...] = tuple(KINDS)


def accepted() -> str:
    return ", ".join(NAMES)


def get(kind: Any) -> JobKind:
    """The registered kind `kind`; ValueError naming the accepted kinds otherwise."""
    found = KINDS.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise ValueError(f"kind: unknown job kind {kind!r}; accepted: {accepted()}")
    return found


def parse_spec(kind: str, data: Any) -> Spec:
    """Validate `data` for job `kind`; SpecError naming each bad field and its accepted range
    (field "kind" for an unknown kind)."""
    if kind not in KINDS:
        raise SpecError([{"field": "kind", "message": f"unknown job kind {kind!r}; accepted: {accepted()}"}])
    return validate_spec(KINDS[kind].spec, data)


def contract(kind: Any) -> Contract:
    """The kind's result contract; ContractError naming the accepted kinds otherwise."""
    if kind not in KINDS:
        raise ContractError(f"kind: got {kind!r}; accepted: {accepted()}")
    return KINDS[kind].contract


def check(result: Mapping[str, Any]) -> None:
    """ContractError unless the result dict matches its kind's contract (names and types)."""
    check_against(contract(result.get("kind")), result)


def parse_result(result: Mapping[str, Any] | TypedResult[Any]) -> TypedResult[Any]:
    """The typed result of a result dict (kind from "kind", else from "job"); ContractError for
    an unknown kind or a known field of the wrong type."""
    if isinstance(result, TypedResult):
        return result
    return parse_with(contract(result_kind(result)), result)


def producers(target: RefTarget) -> tuple[str, ...]:
    """The kinds whose succeeded jobs provide `target` (a `job:N` in a field of that target)."""
    return tuple(k.name for k in KINDS.values() if target in k.outputs)


def kind_of_spec(spec: Any) -> str:
    """The kind whose spec class `spec` is an instance of."""
    for k in KINDS.values():
        if type(spec) is k.spec:
            return k.name
    raise RegistryError(f"{type(spec).__name__} is not the spec of any job kind")


def ref_values(kind: str, spec: Any) -> dict[str, tuple[str, RefTarget]]:
    """field -> (what the spec names, its target), for the reference fields of `kind` that the
    spec fills: KIND.refs, the one place that says which fields are references, plus the
    references a kind implies (a retention job's default OPD teacher counts as given: it is what
    the worker loads). The product's resolver (app.services.refs) and the library callers' one
    (compute.jobs.artifact_files.resolved_refs) both walk this list."""
    job_kind = get(kind)
    implied = dict(job_kind.implied_refs(spec)) if job_kind.implied_refs else {}
    out: dict[str, tuple[str, RefTarget]] = {}
    for field, target in job_kind.refs.items():
        value = getattr(spec, field, None)
        if not value:
            value = implied.get(field)
        if isinstance(value, str) and value.strip():
            out[field] = (value.strip(), target)
    return out


def ref_targets() -> dict[str, RefTarget]:
    """Every reference field of any kind -> its target (a field means the same in every kind)."""
    out: dict[str, RefTarget] = {}
    for k in KINDS.values():
        for f, t in k.refs.items():
            if out.setdefault(f, t) != t:
                raise RegistryError(f"compute/jobs/{k.name}.py: KIND.refs[{f!r}] is {t!r}, "
                                    f"but another kind declares {out[f]!r}")
    return out
