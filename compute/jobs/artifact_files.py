"""The engine's side of references: the resolved `Ref` of a spec field, and the float tensors
of a Fisher / mask / gradient file. Used by the mask, train, diff, sweep and retention jobs.

No database and no resolving here: the product resolves every reference once, at validation
(app.services.refs), and a runner receives the Refs (`run(spec, progress, refs)`), fetched by
the worker (sha256 re-verified). Library callers that pass no refs (tests, notebooks) get
`compute.contract.modelref.name_ref`: a model by name or a file by path, never `job:N`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from compute.contract.kinds import Ref


def resolved_refs(spec: Any, refs: Mapping[str, Ref] | None) -> dict[str, Ref]:
    """The references a runner reads, called once where a runner is entered (run, run_child,
    combine and the public helpers that take `refs`): `refs` as the product's resolver made them
    (app.services.refs; the worker and the CLI always pass them), or, for a library caller that
    passes none (tests, notebooks, benchmarks), each reference field the spec fills
    (compute.jobs.registry.ref_values: the same list the product resolver walks) named directly
    by compute.contract.modelref.name_ref (a zoo name, a folder, a file path; never job:N).
    Afterwards the runner only reads `refs.get(field)`."""
    if refs is not None:
        return dict(refs)
    from compute.contract.modelref import name_ref
    from compute.jobs import registry

    kind = registry.kind_of_spec(spec)
    return {field: name_ref(field, value, target)
            for field, (value, target) in registry.ref_values(kind, spec).items()}


def local_file(ref: Ref | str | Path, kind: str) -> Path:
    """The local file a Fisher / mask / gradient reference names (a Ref, or a path for library
    callers: a folder holding `<kind>.safetensors` names that file)."""
    if isinstance(ref, Ref):
        return Path(ref.where())
    from compute.contract.modelref import name_ref

    return Path(name_ref(kind, str(ref), kind).where())


def load_scores(ref: Ref | str | Path, kind: str = "fisher") -> dict[str, torch.Tensor]:
    """name -> float32 tensor from a safetensors file (a Ref, or a path for library callers)."""
    from safetensors.torch import load_file

    path = local_file(ref, kind)
    shown = ref.given if isinstance(ref, Ref) else str(ref)
    try:
        data = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse error is a user error about this file
        raise ValueError(f"{kind}: cannot read {shown} as safetensors ({type(exc).__name__}: {exc})") from None
    out = {n: t.float() for n, t in data.items() if t.is_floating_point()}
    if not out:
        raise ValueError(f"{kind}: {shown} holds no floating-point tensors")
    return out


def stored_metadata(ref: Ref | str | Path, kind: str) -> dict[str, str]:
    """The safetensors metadata of an artifact file (a Ref, or a path for library callers); {}
    when it has none."""
    from safetensors import safe_open

    path = local_file(ref, kind)
    try:
        with safe_open(str(path), framework="pt") as h:
            return dict(h.metadata() or {})
    except Exception:  # noqa: BLE001 - unreadable files fail where their tensors are loaded
        return {}


def fisher_provenance(ref: Ref | str | Path, kind: str = "fisher") -> dict[str, Any]:
    """The reliability (split-half verdict) and precision of the Fisher stored at `ref`, as a
    result built on it shows them (summary "fisher_reliability"; issue 18).

    A fisher file carries them in its metadata ("fisherlens", compute.jobs.fisher_run.fisher_metadata);
    a file built on a Fisher (a mask) carries that Fisher's ("fisher_reliability",
    compute.jobs.mask_run): the file's own metadata says which, whatever `kind` it is read as. A file
    written before, or by other tools, gets a note that its reliability is unknown.

    "source" names the Fisher, and for a Ref (the worker's and the CLI's runs) never by path: its
    label ('job:3', 'fisher.safetensors (local file)', compute.contract.provenance) with
    "source_sha256", the sha256 the file was resolved with; a mask's copy keeps the label and
    sha256 of the Fisher it was built on. Library callers that pass a path see that path. A path
    in an older file's "model" or "source" is read back as its label: nothing here depends on it."""
    import json

    from compute.contract.provenance import ref_provenance, value_label

    meta = stored_metadata(ref, kind)
    if isinstance(ref, Ref):
        prov = ref_provenance(ref)
        shown, sha = prov["label"], prov["sha256"]
    else:
        shown, sha = str(ref), None
    own = "fisherlens" in meta  # the Fisher itself, not a file built on one
    raw = meta.get("fisherlens") if own else meta.get("fisher_reliability")
    try:
        info = json.loads(raw) if raw else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        out: dict[str, Any] = {"source": shown, "reliability": "none",
                               "note": "the Fisher's split-half reliability is unknown (a file stored without it)"}
        if sha:
            out["source_sha256"] = sha
        return out
    for key, target in (("model", "model"), ("source", "fisher")):
        if key in info:
            info[key] = value_label(info[key], target)
    if own:
        info["source"] = shown
        if sha:
            info["source_sha256"] = sha
    return info
