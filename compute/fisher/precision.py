"""The error of a half-precision Fisher against float32, measured within the job's memory.

A bf16/fp16 Fisher states its error (issue 18): the first rows of its own rollout are scored by
the model as it is and by the checkpoint in float32, and the two Fishers compared. Issue 30: that
reference used to be a second copy of the model loaded in float32 (4 bytes/param beside the job),
and the comparison made float64 copies of whole tensors. Here the reference is the job's own
model, its parameters made float32 in place (2 bytes/param more for bf16 weights, one tensor in
flight) and given back bit for bit afterwards:
- where the model came from a local safetensors checkpoint stored wider than the model (a float32
  checkpoint loaded in bf16), each tensor takes the checkpoint's float32 values, so the error
  includes the rounding of the weights, as loading the checkpoint in float32 would; a tensor is
  taken from the file only when the file's values cast to the model's dtype are bit for bit the
  loaded ones, which is also what makes the restore exact;
- other tensors (bf16 checkpoints, GGUF, tensors renamed on load) are upcast, exactly: their
  float32 values are the loaded ones.
The comparison streams in float64 over slices (compute.fisher.l1_parts), and the top-k
Jaccard is the streaming one (compute.fisher.statistics.topk_jaccard).

Memory (what `check_bytes` says and compute.jobs.fisher_run checks against the job's room):
the half-precision Fisher's sums (4 bytes/param, handed to the CPU when done), the parameters'
widening (4 - itemsize bytes/param) and the reference's sums (4 bytes/param) on the device; on a
CPU all of them are in the one memory.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

HALF = (torch.bfloat16, torch.float16)


def check_bytes(model: nn.Module) -> int:
    """Peak bytes the check adds on the model's device above the job's state at that point."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    widen = sum(p.numel() * max(0, 4 - p.element_size()) for p in params)
    on_cpu = params[0].device.type == "cpu" if params else True
    # on a GPU the half-precision sums leave the device before the model is widened
    return widen + (8 if on_cpu else 4) * n


def _checkpoint_index(model: nn.Module) -> dict[str, str]:
    """tensor name -> safetensors file of the local folder the model was loaded from ({} when it
    was not loaded from one)."""
    folder = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not folder or not os.path.isdir(str(folder)):
        return {}
    from safetensors import safe_open

    index: dict[str, str] = {}
    for f in sorted(glob.glob(os.path.join(str(folder), "*.safetensors"))):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                index.setdefault(k, f)
    return index


@contextlib.contextmanager
def float32_weights(model: nn.Module, from_checkpoint: bool = True) -> Iterator[dict[str, int]]:
    """The model with float32 parameters (and floating buffers) for the duration, in place; on
    exit every parameter and buffer is bit for bit what it was. Yields counts: tensors taken from
    the checkpoint ("from_checkpoint") and upcast ("upcast"). from_checkpoint False: every half
    tensor upcast (its own values, the ones a training run trains: compute.jobs.train_run)."""
    index = _checkpoint_index(model) if from_checkpoint else {}
    counts = {"from_checkpoint": 0, "upcast": 0}
    params = dict(model.named_parameters())  # tied weights once
    dtypes = {n: p.dtype for n, p in params.items()}
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
    for mod in model.modules():
        for bn, b in list(mod._buffers.items()):
            if b is not None and b.dtype in HALF:
                buffers.append((mod, bn, b))
    handles: dict[str, Any] = {}
    try:
        from safetensors import safe_open

        for n, p in params.items():
            d0 = p.dtype
            value = None
            if d0 in HALF and n in index:
                f = index[n]
                if f not in handles:
                    handles[f] = safe_open(f, framework="pt").__enter__()
                t = handles[f].get_tensor(n)
                if (t.shape == p.shape and t.is_floating_point() and t.element_size() > p.element_size()
                        and torch.equal(t.to(device=p.device, dtype=d0), p.data)):
                    value = t.to(device=p.device, dtype=torch.float32)
                del t
            if d0 in HALF:
                counts["from_checkpoint" if value is not None else "upcast"] += 1
                p.data = value if value is not None else p.data.float()
        for mod, bn, b in buffers:
            mod._buffers[bn] = b.float()
        yield counts
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
        for n, p in params.items():
            if p.dtype != dtypes[n]:
                p.data = p.data.to(dtypes[n])  # exact: the values are the loaded ones, widened
        for mod, bn, b in buffers:
            mod._buffers[bn] = b


def precision_error(model: nn.Module, roll: Any, estimator: str, memory_budget_mb: int | None = None,
                    rows: int = 16, topk_percent: float = 1.0) -> dict[str, Any] | None:
    """The error of a half-precision Fisher, measured: the first `rows` sampled completions
    scored by the model as it is and by the same model in float32 (module docstring). The same
    completions, so the difference is the precision alone. None for a float32/float64 model.

    -> {relative_l1 (whole model), worst_tensor_relative_l1, worst_tensor, topk_jaccard (top-k%
    sets), topk_percent, rows, dtype, reference}."""
    from compute.fisher import fisher_from_samples, l1_parts
    from compute.fisher import statistics as analysis

    dtype = next(model.parameters()).dtype
    if dtype not in HALF:
        return None
    n = min(rows, roll.input_ids.shape[0])
    ids, am, cm = (t[:n] for t in (roll.input_ids, roll.attention_mask, roll.completion_mask))
    est = "sequence" if estimator == "empirical" else estimator
    # the same rows per forward on both sides (a half-precision result depends on the batch's
    # shape), as many as the temporaries budget holds (the engine's own sizing: a tied embedding's
    # per-row buffer is vocab x hidden a row)
    from compute.fisher.estimators import rows_per_forward

    bs = min(n, rows_per_forward(model, int(ids.shape[1]), memory_budget_mb))
    low = fisher_from_samples(model, ids, am, cm, est, memory_budget_mb=memory_budget_mb, batch_size=bs)
    with float32_weights(model) as counts:
        ref = fisher_from_samples(model, ids, am, cm, est, memory_budget_mb=memory_budget_mb, batch_size=bs)
    num = den = 0.0
    per: dict[str, float] = {}
    for name in ref:
        d, r = l1_parts(low[name], ref[name])
        num, den = num + d, den + r
        per[name] = 0.0 if r == 0 and d == 0 else (d / r if r > 0 else float("inf"))
    worst = max(per, key=lambda k: per[k])
    jac = analysis.topk_jaccard(low, ref, topk_percent)
    if counts["from_checkpoint"] and not counts["upcast"]:
        reference = "the checkpoint's float32 values, on the same sampled completions"
    elif counts["from_checkpoint"]:
        reference = (f"the checkpoint's float32 values ({counts['from_checkpoint']} tensors; "
                     f"{counts['upcast']} not in its files upcast exactly), on the same sampled completions")
    else:
        reference = ("the loaded weights computed in float32 (the checkpoint holds no wider values), "
                     "on the same sampled completions")
    return {"relative_l1": num / den if den > 0 else 0.0, "worst_tensor_relative_l1": per[worst],
            "worst_tensor": worst, "topk_jaccard": jac, "topk_percent": topk_percent, "rows": n,
            "dtype": str(dtype).replace("torch.", ""), "reference": reference, "rows_per_forward": bs}
