"""The one rule for "do these tensors belong together": parameter names and shapes, compared
the same way wherever they are checked. Submit checks references from their safetensors headers
(app.services.compat: a Fisher or mask for another model, base and tuned of two architectures)
and the engine re-checks what it was handed (compute.sparsity.masks, compute.sparsity.diff, compute.jobs.mask_run: a
library caller has no validation in front of it), both with `mismatch`, so the same pair gets
the same answer and the same message. Pure (standard library only)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Shapes = Mapping[str, Iterable[int]]


def shapes_of(tensors: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """name -> shape of anything with `.shape` (tensors, safetensors slices)."""
    return {n: tuple(t.shape) for n, t in tensors.items()}


def mismatch(part: Shapes, whole: Shapes, part_name: str, whole_name: str, *,
             both: bool = False, tied_ok: bool = False) -> str | None:
    """Why `part` does not fit `whole` (name -> shape), or None: the first parameter (sorted)
    of `part` missing from `whole` (with `both`, also of `whole` missing from `part`) or with
    another shape there. `tied_ok`: a missing `lm_head.weight` is a tied output layer, saved once
    as the embedding, and fits."""
    names = set(part) | (set(whole) if both else set())
    for n in sorted(names):
        if n not in whole:
            if tied_ok and n.endswith("lm_head.weight"):
                continue
            return f"parameter {n!r} is in {part_name} but not in {whole_name}"
        if n not in part:
            if tied_ok and n.endswith("lm_head.weight"):
                continue
            return f"parameter {n!r} is in {whole_name} but not in {part_name}"
        a, b = tuple(part[n]), tuple(whole[n])
        if a != b:
            return f"parameter {n!r} has shape {list(a)} in {part_name} but {list(b)} in {whole_name}"
    return None
