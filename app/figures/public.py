"""How a result read through its share token names its references: never a server path.

A spec names a model, a run folder or a Fisher / mask file by zoo name, hub id, `job:N` or a path
on the server (app/services/refs.py resolves each into a Ref, stored with the job as `jobs.refs`).
Everything read by share token (the share page `/r/<token>`, `/api/results/<token>` and its stats
downloads, the explorer's result tab, which also serves share links) shows the reference as:

    job:N                   an artifact of a job (what the user wrote)
    the hub id / zoo name   as given
    a name                  a model registered by name (what the user wrote)
    grpo (local folder)     a model or run folder given by path: its base name
    f.safetensors (local file)  a fisher / mask / gradient file given by path

in the job's spec, in the result summary (which repeats the spec's references) and in heatmap
metadata. The owner's own job API (`/api/jobs/N`, `fisherlens status`) keeps the full spec: it is
what Rerun submits again.

This module is part of FIGURES_KEY (app/figures/store.py hashes the package): payloads built
before it, which may hold a path, are rebuilt on their next view.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PureWindowsPath
from typing import Any

FOLDER_TARGETS = ("model", "run_dir")


def _is_path(value: str) -> bool:
    """A value written as a path (absolute, relative with a folder, ~, ./), not a name."""
    return "/" in value or "\\" in value or value.startswith(("~", "."))


def _base_name(path: str) -> str:
    return PureWindowsPath(path.rstrip("/\\")).name or path  # splits on both / and \\


def path_label(path: str, target: str) -> str:
    """'grpo (local folder)' / 'fisher.safetensors (local file)' for a path on the server."""
    return f"{_base_name(path)} ({'local folder' if target in FOLDER_TARGETS else 'local file'})"


def ref_label(ref: Mapping[str, Any]) -> str:
    """How a stored Ref (compute.contract.kinds.Ref as JSON) is shown to a share-link reader."""
    given = str(ref.get("given") or "")
    form = ref.get("form")
    if form == "artifact":
        return f"job:{ref['job_id']}" if ref.get("job_id") is not None else given
    if form == "hub" or not _is_path(given):
        return given  # a hub id, a zoo or registered model's name
    path = str(ref.get("path") or given)
    if form == "zoo":
        return _base_name(path)  # the zoo model's name
    return path_label(path, str(ref.get("target") or ""))


def public_names(kind: str | None, spec: Mapping[str, Any] | None,
                 refs: Mapping[str, Any] | None) -> dict[str, str]:
    """{server path or what the user wrote: its label} for every reference of the job that was
    given by path. Jobs stored before refs existed: the spec's reference fields holding an
    absolute path (or ~) get the base-name label."""
    names: dict[str, str] = {}
    for ref in (refs or {}).values():
        if not isinstance(ref, Mapping) or ref.get("form") not in ("local", "zoo"):
            continue
        label = ref_label(ref)
        for raw in (ref.get("given"), ref.get("path")):
            if isinstance(raw, str) and raw.strip() and raw != label and _is_path(raw):
                names[raw] = label
    try:
        from compute.jobs import registry

        fields = dict(registry.get(str(kind)).refs) if kind in registry.KINDS else {}
    except Exception:  # noqa: BLE001 - an unknown kind: no reference fields known
        fields = {}
    for field, target in fields.items():
        value = (spec or {}).get(field)
        if isinstance(value, str) and value not in names and value.strip().startswith(("/", "~", "\\")):
            names[value] = path_label(value.strip(), target)
    return names


def scrub(obj: Any, names: Mapping[str, str]) -> Any:
    """`obj` with every string equal to a key of `names` replaced by its label, and every path
    key inside a longer string too (a copy; dicts and lists walked)."""
    if not names:
        return obj
    if isinstance(obj, str):
        if obj in names:
            return names[obj]
        for raw in sorted(names, key=len, reverse=True):
            if len(raw) > 1 and raw in obj:
                obj = obj.replace(raw, names[raw])
        return obj
    if isinstance(obj, Mapping):
        return {k: scrub(v, names) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [scrub(v, names) for v in obj]
    return obj


def public_job(job: dict[str, Any], refs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A job dict whose spec names its references by label."""
    names = public_names(job.get("kind"), job.get("spec"), refs)
    return {**job, "spec": scrub(job.get("spec"), names)} if names and job.get("spec") else job


def public_result(result: dict[str, Any], refs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A result dict (storage.results.result_dict) whose job spec, summary and heatmap metadata
    name the job's references by label."""
    job = result.get("job") or {}
    names = public_names(result.get("kind") or job.get("kind"), job.get("spec"), refs)
    if not names:
        return result
    out = {**result, "job": {**job, "spec": scrub(job.get("spec"), names)},
           "summary": scrub(result.get("summary"), names)}
    if result.get("heatmaps"):
        out["heatmaps"] = [{**h, "meta": scrub(h.get("meta"), names)} for h in result["heatmaps"]]
    return out
