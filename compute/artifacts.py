"""Artifact files named in specs: a plain path (or a folder holding `<kind>.safetensors`) or a
'job:<id>' reference (compute.contract.modelref resolves those: database + artifact store), and the
float tensors they hold. Used by the mask, train, diff and sweep jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def resolve_artifact(ref: str, kind: str) -> Path:
    """A plain path to an existing file, or a 'job:<id>' reference.

    kind is the artifact kind and the field name in errors ("fisher", "mask", "gradient")."""
    ref = str(ref).strip()
    if ref.startswith("job:"):
        from compute.contract.modelref import (
            resolve_job_ref,  # the one resolver of job:N (DB + store)
        )

        return resolve_job_ref(ref, kind).path
    path = Path(ref).expanduser()
    if path.is_dir() and (path / f"{kind}.safetensors").is_file():
        path = path / f"{kind}.safetensors"
    if not path.is_file():
        raise ValueError(f"{kind}: file not found: {ref}")
    return path


def load_scores(ref: str, kind: str = "fisher") -> dict[str, torch.Tensor]:
    """name -> float32 tensor from a safetensors file (path or 'job:<id>')."""
    from safetensors.torch import load_file

    path = resolve_artifact(ref, kind)
    try:
        data = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse error is a user error about this file
        raise ValueError(f"{kind}: cannot read {path} as safetensors ({type(exc).__name__}: {exc})") from None
    out = {n: t.float() for n, t in data.items() if t.is_floating_point()}
    if not out:
        raise ValueError(f"{kind}: {path} holds no floating-point tensors")
    return out


def stored_metadata(ref: str, kind: str) -> dict[str, str]:
    """The safetensors metadata of an artifact file (path or 'job:<id>'); {} when it has none."""
    from safetensors import safe_open

    path = resolve_artifact(ref, kind)
    try:
        with safe_open(str(path), framework="pt") as h:
            return dict(h.metadata() or {})
    except Exception:  # noqa: BLE001 - unreadable files fail where their tensors are loaded
        return {}


def fisher_provenance(ref: str, kind: str = "fisher") -> dict[str, Any]:
    """The reliability (split-half verdict) and precision of the Fisher stored at `ref`, as a
    result built on it shows them (summary "fisher_reliability"; issue 18).

    A fisher file carries them in its metadata ("fisherlens", compute.run_fisher.fisher_metadata);
    a mask file carries its Fisher's ("fisher_reliability", compute.run_mask). A file written
    before, or by other tools, gets a note that its reliability is unknown."""
    import json

    meta = stored_metadata(ref, kind)
    raw = meta.get("fisherlens") if kind == "fisher" else meta.get("fisher_reliability")
    try:
        info = json.loads(raw) if raw else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return {"source": str(ref), "reliability": "none",
                "note": "the Fisher's split-half reliability is unknown (a file stored without it)"}
    if kind == "fisher":
        info["source"] = str(ref)
    return info
