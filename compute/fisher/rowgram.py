"""Inner products of per-row gradients that share one forward, without forming the gradients.

The rows are output cotangents u_r on one forward's logits z (V,): row r's gradient is
g_r = J^T u_r (J = dz/dθ), e.g. u = e_v for token v's logit, u = p for gbar, u = e_v - p for
g_v - gbar. One vmapped backward (`autograd.grad(..., is_grads_batched=True)`) gives, for every
captured module call, the cotangent C_r of its output; the per-row gradient of its parameter is
then a product of two small factors, G_r = A_r^T B_r with A (L, m), B (L, n):

  nn.Linear   (out, in)   A = C_r (row)        B = x (shared)
  Conv1D      (in, out)   A = x (shared)       B = C_r (row)
  Embedding   (V, d)      A = one-hot ids      B = scale * C_r (row)
  other       explicit per-row gradients (persample.generic_row_grads), as A = G_r, B = 1

and <G_r, G_s> = sum_{t,t'} (A_r A_s^T)_{tt'} (B_r B_s^T)_{tt'}, contracted in the order that
keeps every temporary (rows, L x L) or (rows, L x m) (`pair_features`). A parameter used by
several calls (tied embeddings) sums over every pair of uses. Cost: one backward per row over
activations only, never a (rows x parameters) matrix.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compute.fisher import persample as ps
from compute.fisher.hooks import embedding_lookup, position_wise
from compute.lm.device import wide


class NotFactorable(RuntimeError):
    """The model has a call the factored path cannot take (the caller falls back)."""


@dataclass
class Capture:
    """One module call: its module, tracked parameters (attribute, name), detached inputs and
    the output tensor (kept in the graph so that its cotangent can be asked for)."""

    module: nn.Module
    names: list[tuple[str, str]]
    args: tuple
    kwargs: dict
    output: torch.Tensor
    lookup: tuple[torch.Tensor, float] | None = None


@dataclass
class CallRecorder:
    """Context manager: forward hooks recording every call of a module that owns a tracked
    parameter (names: id(param) -> name); removed in `__exit__`, also on errors."""

    model: nn.Module
    names: dict[int, str]
    calls: list[Capture] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)

    def __enter__(self) -> CallRecorder:
        try:
            for module in self.model.modules():
                own = [(k, self.names[id(p)]) for k, p in module._parameters.items()
                       if p is not None and id(p) in self.names]
                if own:
                    self.handles.append(module.register_forward_hook(
                        self._hook(own), with_kwargs=True))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook(self, own: list[tuple[str, str]]) -> Any:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if not torch.is_grad_enabled():
                return
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                raise NotFactorable(f"{type(mod).__name__} returns no differentiable tensor")
            lookup = embedding_lookup(mod, args, kwargs, out) if isinstance(mod, nn.Embedding) \
                else None
            det = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            kw = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            self.calls.append(Capture(mod, own, det, kw, out, lookup))

        return hook


def _batch1(t: torch.Tensor) -> torch.Tensor:
    """(1, L, ...) for a call on one sequence; (L, ...) position-wise calls get the 1."""
    return t if t.shape[0] == 1 else t.unsqueeze(0)


def call_factors(call: Capture, C: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (A, B) factors of each parameter's per-row gradients for cotangents C (R, *out).

    Factors are (R or 1, L, m) and (R or 1, L, n); batch 1 = shared by all rows."""
    mod, R = call.module, C.shape[0]
    out = call.output
    if out.shape[0] != 1 and not position_wise(mod):
        raise NotFactorable(f"{type(mod).__name__} output is not one sequence")
    g = wide(C.reshape(R, *_batch1(out).shape[1:]))  # (R, L, ...)
    res: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if isinstance(mod, nn.Linear) or ps.is_conv1d(mod):
        x = call.args[0] if call.args else next(iter(call.kwargs.values()))
        xf = wide(x.reshape(1, -1, x.shape[-1]))  # (1, L, in)
        gf = g.reshape(R, -1, g.shape[-1])  # (R, L, out)
        keep = gf.abs().amax((0, 2)) != 0  # positions no row's gradient reaches are dropped
        xf, gf = xf[:, keep], gf[:, keep]
        for key, name in call.names:
            if key == "bias":
                res[name] = (gf.sum(1, keepdim=True), torch.ones_like(gf[:1, :1, :1]))
            else:
                res[name] = (xf, gf) if ps.is_conv1d(mod) else (gf, xf)
        return res
    if isinstance(mod, nn.Embedding) and call.lookup is not None:
        ids, scale = call.lookup
        (_, name), = call.names
        gf = g.reshape(R, -1, g.shape[-1]) * scale  # (R, L, d)
        ids = ids.reshape(-1)
        if mod.padding_idx is not None:
            gf = gf * (ids != mod.padding_idx).unsqueeze(-1)
        onehot = nn.functional.one_hot(ids, mod.num_embeddings).to(gf.dtype).unsqueeze(0)
        return {name: (onehot, gf)}
    def rows(a: Any) -> Any:  # the one sequence's inputs, seen by every row
        return _batch1(a).expand(R, *_batch1(a).shape[1:]) \
            if isinstance(a, torch.Tensor) and a.dim() > 0 else a

    args = tuple(rows(a) for a in call.args)
    kwargs = {k: rows(v) for k, v in call.kwargs.items()}
    params = [k for k, _ in call.names]
    local = dict(call.names)
    parts: dict[str, list[torch.Tensor]] = {}
    for _, grads in ps.generic_row_grads(module=mod, params=params, args=args,
                                         kwargs=kwargs, g=g, rows_per_chunk=R):
        for k, gr in grads.items():
            parts.setdefault(local[k], []).append(gr.reshape(gr.shape[0], 1, -1))
    for name, chunks in parts.items():
        e = torch.cat(chunks)  # (R, 1, numel)
        res[name] = (e, torch.ones_like(e[:1, :, :1]))
    return res


def pair_features(a1: torch.Tensor, b1: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(left (R1, F), right (R2, F)) with left[r] . right[s] = <A1_r^T B1_r, A2_s^T B2_s>_F.

    Each factor is (R or 1, L, .): batch 1 = shared; one of A1/B1 and one of A2/B2 is shared."""
    sh = [t.shape[0] == 1 for t in (a1, b1, a2, b2)]
    if sh[1] and sh[3]:  # B shared on both sides: <A1_r, (B1 B2^T) A2_s>
        k = b1[0] @ b2[0].T  # (L1, L2)
        return a1.flatten(1), (k @ a2).flatten(1)
    if sh[0] and sh[2]:  # A shared on both sides
        k = a1[0] @ a2[0].T
        return b1.flatten(1), (k @ b2).flatten(1)
    if sh[0] and sh[3]:  # A1, B2 shared: (B1_r B2^T) . (A1 A2_s^T)
        return (b1 @ b2[0].T).flatten(1), (a1[0] @ a2.transpose(1, 2)).flatten(1)
    if sh[1] and sh[2]:  # B1, A2 shared: (A1_r A2^T) . (B1 B2_s^T)
        return (a1 @ a2[0].T).flatten(1), (b1[0] @ b2.transpose(1, 2)).flatten(1)
    raise NotFactorable("a use without a shared factor")


def inner_products(uses_r: list[tuple[torch.Tensor, torch.Tensor]],
                   uses_s: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                   ) -> torch.Tensor:
    """<g_r, g_s> of one parameter summed over every pair of its uses: (R1, R2) for two row sets;
    the diagonal (R1,) <g_r, g_r> when uses_s is None. float64."""
    out: torch.Tensor | None = None
    for a1, b1 in uses_r:
        for a2, b2 in uses_s if uses_s is not None else uses_r:
            left, right = pair_features(a1, b1, a2, b2)
            if uses_s is None:
                val = (left * right).sum(1, dtype=torch.float64)
                val = val.expand(max(a1.shape[0], b1.shape[0]))
            else:
                val = (left @ right.T).double()
                val = val.expand(max(a1.shape[0], b1.shape[0]), val.shape[1])
            out = val.clone() if out is None else out + val
    assert out is not None
    return out


def cotangents(z: torch.Tensor, calls: list[Capture], u: torch.Tensor) -> list[torch.Tensor]:
    """Cotangents (R, *out.shape) of every captured call's output for output cotangents
    u (R, V) on z: one vmapped backward over activations."""
    outs = [c.output for c in calls]
    grads = torch.autograd.grad(z, outs, grad_outputs=u.to(z.dtype), retain_graph=True,
                                allow_unused=True, is_grads_batched=True)
    return [g if g is not None else torch.zeros((u.shape[0], *o.shape), dtype=o.dtype,
                                                device=o.device)
            for g, o in zip(grads, outs, strict=True)]


def row_factors(z: torch.Tensor, calls: list[Capture], u: torch.Tensor,
                ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """name -> factors of each use, for the rows u (R, V)."""
    uses: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for call, C in zip(calls, cotangents(z, calls, u), strict=True):
        for name, fac in call_factors(call, C).items():
            uses.setdefault(name, []).append(fac)
    for name, facs in uses.items():
        explicit = [b.shape[1:] == (1, 1) for _, b in facs]
        if len(facs) > 1 and any(explicit) and not all(explicit):
            raise NotFactorable(f"{name}: used by a linear/embedding call and another module")
    return uses


def row_chunks(n: int, step: int) -> Iterator[slice]:
    for s in range(0, n, max(1, step)):
        yield slice(s, min(n, s + max(1, step)))
