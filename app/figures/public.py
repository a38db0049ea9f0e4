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
from typing import Any

# the labelling rules are shared with the files a job writes (compute.contract.provenance)
from compute.contract.provenance import (  # noqa: F401 - re-exported
    FOLDER_TARGETS,
    path_label,
    path_names,
    ref_label,
    scrub,
)


def public_names(kind: str | None, spec: Mapping[str, Any] | None,
                 refs: Mapping[str, Any] | None) -> dict[str, str]:
    """{server path or what the user wrote: its label} for every reference of the job that was
    given by path. Jobs stored before refs existed: the spec's reference fields holding an
    absolute path (or ~) get the base-name label."""
    names = path_names({k: r for k, r in (refs or {}).items() if isinstance(r, Mapping)})
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
