"""The per-tensor table of the results whose tensors can be opened (fisher, mask, diff): one row
per stored tensor, its cell and its main numbers. A click on a row opens the tensor
(app/explore/: the first column is "tensor", app/render.py marks the table)."""

from __future__ import annotations

from typing import Any

from compute.contract.results import TypedResult

from .common import Table, cell
from .labels import layer_name
from .registry import table

VALUES = {"fisher": (("mean", "mean F"), ("share", "share of mass"), ("max", "max F")),
          "mask": (("density", "kept fraction"),),
          "diff": (("unchanged_exact", "unchanged (exact)"), ("delta_rms", "rms |delta|"),
                   ("max_abs_delta", "max |delta|"))}
TITLE = "Per-tensor statistics (click a row to open the tensor)"


def tensor_rows(r: TypedResult[Any]) -> Table:
    rows = [s for s in r.stats("tensor") if s.param]
    if not rows:
        return [], []
    keys = [(k, label) for k, label in VALUES.get(r.kind, ()) if any(k in s.values for s in rows)]
    headers = ["tensor", "layer", "module", "coordinates", *[label for _, label in keys]]
    return headers, [[s.param, layer_name(s.layer, s.module), s.module, cell(s.values.get("numel")),
                      *[cell(s.values.get(k)) for k, _ in keys]] for s in rows]


for _kind in VALUES:
    table(_kind, "tensors", title=TITLE)(tensor_rows)
