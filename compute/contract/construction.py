"""The one rule for numbers that hold by construction (issue 27): what a Fisher-vs-update metric
of a run trained inside a mask may claim.

A run trained inside a mask cannot move the coordinates the mask froze (compute/train/loop.py zeroes
their gradients before the step and before the gradient sums). Over all coordinates, a Fisher's
AUC / precision@k / Spearman / captured share for "what the run changed" is then mostly the
statement that the mask was applied: when the mask was chosen from that very Fisher it holds by
construction, and with another Fisher it measures how well that Fisher agrees with the mask's.
So, for every kind (train's concentration and update sparsity, diff, series):

- the headline metrics are computed over the coordinates free to move (inside the mask), and
  say so (`SCOPE_INSIDE`);
- a metric over all coordinates is kept only labelled: `BY_CONSTRUCTION` when the mask was
  chosen from this Fisher (their provenance sha256s match), else `FROZEN_INCLUDED`.

Pure (standard library only): the runners decide with `scope`, the figures label with its text.
"""

from __future__ import annotations

from typing import Any

SCOPE_INSIDE = "inside the mask: the coordinates free to move"
SCOPE_ALL = "all coordinates"
BY_CONSTRUCTION = "holds by construction: the mask was chosen from this Fisher"
FROZEN_INCLUDED = ("includes the coordinates the mask froze, which cannot move: it measures the "
                   "mask as much as the Fisher")
MASK_FILE = "mask.safetensors"  # the mask a train job trained in, next to its model and checkpoints


def scope(trained_in_mask: bool, *, density: float | None = None, mask_fisher_sha256: str | None = None,
          fisher_sha256: str | None = None, mask_label: str | None = None) -> dict[str, Any]:
    """How a result's Fisher-vs-update metrics are scoped:

    {"trained_in_mask", "scope": SCOPE_INSIDE | SCOPE_ALL, "mask_density", "mask",
     "same_fisher": True | False | None (unknown), "all_coordinates": the label of any metric
     over all coordinates (None without a mask)}."""
    if not trained_in_mask:
        return {"trained_in_mask": False, "scope": SCOPE_ALL, "all_coordinates": None}
    same = (mask_fisher_sha256 == fisher_sha256) if mask_fisher_sha256 and fisher_sha256 else None
    return {"trained_in_mask": True, "scope": SCOPE_INSIDE, "mask_density": density, "mask": mask_label,
            "same_fisher": same, "all_coordinates": BY_CONSTRUCTION if same else FROZEN_INCLUDED}


def scoped_label(label: str, sc: dict[str, Any] | None) -> str:
    """A metric's label with its scope when the run was trained inside a mask."""
    if sc and sc.get("trained_in_mask"):
        return f"{label} ({SCOPE_INSIDE})"
    return label
