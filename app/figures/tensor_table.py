"""The per-tensor table of the results whose tensors can be opened (every kind whose KIND declares
`tensors`, compute.contract.kinds.TensorView): one row per stored tensor, its cell and its main
numbers. A click on a row opens the tensor (app/explore/: the first column is "tensor",
app/render.py marks the table)."""

from __future__ import annotations

from typing import Any

from compute.contract.results import TypedResult
from compute.jobs import registry

from .common import Table, cell
from .labels import layer_name
from .registry import table

# per-tensor statistics worth a column, in this order, with their headers (a result shows those it has)
VALUES = (("mean", "mean"), ("share", "share of the total"), ("max", "max"), ("density", "kept fraction"),
          ("unchanged_common", "unchanged (as stored; the lower precision when they differ)"),
          ("delta_rms", "rms |delta|"), ("max_abs_delta", "max |delta|"))
TITLE = "Per-tensor statistics (click a row to open the tensor)"


def tensor_rows(r: TypedResult[Any]) -> Table:
    rows = [s for s in r.stats("tensor") if s.param]
    if not rows:
        return [], []
    keys = [(k, label) for k, label in VALUES if any(k in s.values for s in rows)]
    headers = ["tensor", "layer", "module", "coordinates", *[label for _, label in keys]]
    return headers, [[s.param, layer_name(s.layer, s.module), s.module, cell(s.values.get("numel")),
                      *[cell(s.values.get(k)) for k, _ in keys]] for s in rows]


table(tuple(k for k, v in registry.KINDS.items() if v.tensors is not None), "tensors", title=TITLE)(tensor_rows)
