"""Artifact files named in specs: a plain path (or a folder holding `<kind>.safetensors`) or a
'job:<id>' reference (compute.contract.modelref resolves those: database + artifact store), and the
float tensors they hold. Used by the mask, train, diff and sweep jobs."""

from __future__ import annotations

from pathlib import Path

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
