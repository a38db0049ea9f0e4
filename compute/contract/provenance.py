"""How a reference is named in what a job stores and serves: by label, never by server path.

A spec names a model, a run folder or a Fisher / mask / gradient file by zoo name, hub id,
`job:N` or a path on the server (app/services/refs.py resolves each into a `Ref`). Everything a
share link reaches shows the reference as

    job:N                       an artifact of a job (what the user wrote)
    the hub id / zoo name       as given
    a name                      a model registered by name (what the user wrote)
    grpo (local folder)         a model or run folder given by path: its base name
    f.safetensors (local file)  a fisher / mask / gradient file given by path

The share pages (app/figures/public.py) relabel a job's spec and summary when read; the files a
job writes (a Fisher's and a mask's safetensors metadata, a trained model's metrics.json) are
labelled when written, each reference with the sha256 it was resolved with (`ref_provenance`),
so where a file came from stays verifiable without the path: a local or artifact file's sha256,
a model folder's content revision (compute.contract.modelref.folder_revision), a run folder's
(run_dir_revision). A hub id is its own revision (no sha256).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PureWindowsPath
from typing import Any

FOLDER_TARGETS = ("model", "run_dir")


def is_path(value: str) -> bool:
    """A value written as a path (absolute, relative with a folder, ~, ./), not a name."""
    return "/" in value or "\\" in value or value.startswith(("~", "."))


def base_name(path: str) -> str:
    return PureWindowsPath(path.rstrip("/\\")).name or path  # splits on both / and \\


def path_label(path: str, target: str) -> str:
    """'grpo (local folder)' / 'fisher.safetensors (local file)' for a path on the server."""
    return f"{base_name(path)} ({'local folder' if target in FOLDER_TARGETS else 'local file'})"


def _data(ref: Any) -> Mapping[str, Any]:
    """A Ref (compute.contract.kinds) or its stored JSON, as a mapping."""
    return ref if isinstance(ref, Mapping) else ref.model_dump(mode="json")


def ref_label(ref: Any) -> str:
    """How a Ref (or a stored Ref as JSON) is named to anyone but its owner."""
    d = _data(ref)
    given = str(d.get("given") or "")
    form = d.get("form")
    if form == "artifact":
        return f"job:{d['job_id']}" if d.get("job_id") is not None else given
    if form == "hub" or not is_path(given):
        return given  # a hub id, a zoo or registered model's name
    path = str(d.get("path") or given)
    if form == "zoo":
        return base_name(path)  # the zoo model's name
    return path_label(path, str(d.get("target") or ""))


def ref_provenance(ref: Any) -> dict[str, Any]:
    """{"label": ref_label, "sha256": what the reference was resolved with, or None when it was
    not hashed (a hub id; a direct CLI run's model folder)}."""
    d = _data(ref)
    return {"label": ref_label(d), "sha256": d.get("sha256")}


def value_label(value: Any, target: str) -> Any:
    """A stored reference value as shown: an absolute path (or ~) becomes its label; names,
    hub ids and job:N stay (for values written before files were labelled)."""
    if isinstance(value, str) and value.strip().startswith(("/", "~", "\\")):
        return path_label(value.strip(), target)
    return value


def path_names(refs: Mapping[str, Any] | None) -> dict[str, str]:
    """{server path or what the user wrote: its label} for every reference given by path."""
    names: dict[str, str] = {}
    for ref in (refs or {}).values():
        d = _data(ref)
        if d.get("form") not in ("local", "zoo"):
            continue
        label = ref_label(d)
        for raw in (d.get("given"), d.get("path"), d.get("local")):
            if isinstance(raw, str) and raw.strip() and raw != label and is_path(raw):
                names[raw] = label
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


def labelled(obj: Any, refs: Mapping[str, Any] | None) -> Any:
    """`obj` (a summary, a spec, metrics) with every reference given by path named by label."""
    return scrub(obj, path_names(refs))


def references(refs: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """{field: ref_provenance} of a job's references: what a file records in place of paths."""
    return {field: ref_provenance(ref) for field, ref in (refs or {}).items()}
