"""The mask-aware optimizer (AdamW, SGD) and training precision.

A fixed mask (name -> bool tensor, True = trainable) freezes every excluded coordinate
completely. `MaskedOptimizer` is our own AdamW/SGD step whose memory is in proportion to the
mask (issue 30) and whose frozen coordinates stay bit-identical:
- a partly trainable tensor is described by `Coords`: the flat indices of its trainable
  coordinates (int32 where the tensor has < 2^31 elements), nothing dense;
- its gradient is folded as it arrives: a post-accumulate-grad hook gathers grad[idx] into a
  float32 buffer of the mask's size (adding to it over micro-batches) and frees .grad, so at most
  one dense gradient (the one being accumulated) is alive at a time;
- optimizer state (Adam moments, SGD momentum) is 1-D at those indices; clipping uses the norm
  of the folded buffers (the trainable coordinates only);
- the step gathers the trainable weights, updates them (AdamW: torch.optim.AdamW's maths,
  decoupled decay on the mask only; SGD: coupled decay, momentum b = mu * b + g) and writes them
  back with index_put_: a frozen coordinate is never written, so it stays bit for bit what it
  was (torch's AdamW multiplies the whole tensor by 1 - lr * wd, which would shrink it).
Tensors entirely outside the mask get requires_grad = False (no gradient is computed for them);
tensors entirely inside carry no Coords and train densely (no extra work).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from compute.train.config import OPTIMIZERS, PRECISIONS

if TYPE_CHECKING:
    from compute.sparsity.masks import CompactMask

# Precision of training (TrainSpec.precision; docs/science.md section 6):
# - fp32: float32 weights, float32 checkpoint;
# - bf16-mixed: float32 master weights that start from the base rounded to bf16 (a published bf16
#   checkpoint), float32 forward/backward, and a checkpoint saved in bf16 (as HF models are
#   published): a stored weight changes only when the accumulated update crosses a bf16 rounding
#   boundary;
# - bf16: weights held in bf16 (forward/backward in bf16, optimizer state float32); each step
#   writes round_bf16(w - update), so an update below half a bf16 ULP of |w| is lost.


def prepare_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Cast `model` in place for training at `precision` (idempotent).

    fp32: float32 weights. bf16-mixed: float32 weights holding bf16-representable values (the base
    rounded to bf16 once, as if loaded from a bf16 checkpoint). bf16: bfloat16 weights.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: got {precision!r}; accepted: {', '.join(PRECISIONS)}")
    if precision == "bf16":
        return model.to(torch.bfloat16)
    if precision == "bf16-mixed":
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16).to(torch.float32)
            for b in model.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(torch.float32)
        return model
    return model.to(torch.float32)


def stored_dtype(precision: str) -> torch.dtype:
    """dtype of the saved checkpoint at `precision` (what a published checkpoint holds)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def stored_state(model: torch.nn.Module, precision: str) -> dict[str, torch.Tensor]:
    """Parameters as the checkpoint stores them at `precision` (CPU copies)."""
    dt = stored_dtype(precision)
    return {n: p.detach().to(device="cpu", dtype=dt).clone() for n, p in model.named_parameters()}


class Coords:
    """The trainable coordinates of one partly masked tensor: `idx`, the sorted flat indices
    (int32 when the tensor has < 2^31 elements, else int64), and `grad`, the tensor's gradient
    at them (float32, 1-D; None until a backward reaches the tensor), summed over the backward
    passes since the last zero_grad."""

    __slots__ = ("idx", "grad", "numel")

    def __init__(self, idx: torch.Tensor, numel: int):
        self.idx, self.numel = idx, numel
        self.grad: torch.Tensor | None = None

    @classmethod
    def of(cls, mask: torch.Tensor, device: torch.device | str | None = None) -> Coords:
        """The Coords of a bool mask tensor (True = trainable)."""
        flat = mask.reshape(-1)
        dt = torch.int32 if flat.numel() < 2**31 else torch.int64
        idx = torch.nonzero(flat).reshape(-1).to(dtype=dt, device=device or mask.device)
        return cls(idx, flat.numel())

    @property
    def count(self) -> int:
        return int(self.idx.numel())

    def fold(self, grad: torch.Tensor) -> None:
        """Add a dense gradient's values at idx into `grad` (the caller frees the dense one)."""
        vals = grad.detach().reshape(-1).index_select(0, self.idx).float()
        if self.grad is None:
            self.grad = vals
        else:
            self.grad.add_(vals)

    def dense(self, values: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """A dense float32 tensor of `shape`: `values` at idx, 0 elsewhere."""
        out = torch.zeros(self.numel, dtype=torch.float32, device=values.device)
        out.index_put_((self.idx.to(values.device),), values.float())
        return out.view(shape)

    def mask(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The bool mask tensor these coordinates came from."""
        out = torch.zeros(self.numel, dtype=torch.bool, device=self.idx.device)
        out.index_put_((self.idx,), torch.ones((), dtype=torch.bool, device=out.device))
        return out.view(shape)


Param = tuple[str, torch.nn.Parameter, Coords | None]


def prepare_masked_params(
    model: torch.nn.Module, mask: Mapping[str, torch.Tensor] | None
) -> list[Param]:
    """(name, param, Coords or None) for each parameter that will train.

    With a mask: names must be parameters of the model with matching shapes (ValueError naming the
    first mismatch); parameters absent from the mask or with an all-False mask are frozen by
    requires_grad = False; an all-True mask is stored as None (dense); a partial one as the Coords
    of its trainable coordinates. Without a mask: all parameters, dense.
    """
    from compute.sparsity.masks import CompactMask

    named = dict(model.named_parameters())
    if mask is None:
        for p in named.values():
            p.requires_grad_(True)
        return [(n, p, None) for n, p in named.items()]
    compact = mask if isinstance(mask, CompactMask) else None
    for n in mask:
        shape = compact.shape_of(n) if compact is not None else tuple(mask[n].shape)
        if n not in named:
            raise ValueError(f"mask: parameter {n!r} is not a parameter of the model")
        if shape != tuple(named[n].shape):
            raise ValueError(
                f"mask: parameter {n!r} has shape {list(shape)} in the mask "
                f"but {list(named[n].shape)} in the model"
            )
    out: list[Param] = []
    for n, p in named.items():
        c = _coords(mask, compact, n, p.device)
        if c is False:
            p.requires_grad_(False)
            continue
        p.requires_grad_(True)
        if not p.is_contiguous():  # the step writes through a flat view
            p.data = p.data.contiguous()
        out.append((n, p, None if c is True else c))
    if not out:
        raise ValueError("mask: selects no coordinate of the model; nothing would train")
    return out


def _coords(mask: Mapping[str, torch.Tensor], compact: CompactMask | None, name: str,
            device: torch.device) -> Coords | bool:
    """True (train densely), False (frozen) or the Coords of one parameter under `mask`; a
    CompactMask (compute.sparsity.masks) gives its indices as they are, never a dense tensor."""
    if compact is not None:
        part = compact.part(name) if name in compact else False
        if isinstance(part, bool):
            return part
        idx = part.to(device)
        return Coords(idx, math.prod(compact.shape_of(name)))
    given = mask.get(name)
    if given is None or not bool(given.any()):
        return False
    return True if bool(given.all()) else Coords.of(given.bool(), device)


def trainable_count(params: list[Param]) -> int:
    """Coordinates that train: the Coords' counts, the whole tensor where dense."""
    return sum(c.count if c is not None else p.numel() for _, p, c in params)


def mask_gradients(params: list[Param]) -> None:
    """Fold any dense gradient still on a partly masked tensor onto its Coords and free it (the
    optimizer's hooks do this as gradients arrive; call after backward, before clipping, for
    gradients set by other means)."""
    for _, p, c in params:
        if c is not None and p.grad is not None:
            c.fold(p.grad)
            p.grad = None


def grads_of(params: list[Param]) -> list[tuple[str, torch.Tensor, Coords | None]]:
    """(name, gradient, Coords or None) of each parameter with one: the dense .grad of a dense
    tensor, the folded 1-D gradient at the Coords of a partly masked one."""
    out = []
    for n, p, c in params:
        g = p.grad if c is None else c.grad
        if g is not None:
            out.append((n, g, c))
    return out


class MaskedOptimizer:
    """AdamW or SGD whose step never changes a masked-out coordinate (see the module docstring).

    AdamW matches torch.optim.AdamW (decoupled decay, bias correction) on the mask; SGD matches
    torch.optim.SGD (coupled decay, momentum buffer b = mu * b + g, no dampening). State of a
    dense tensor is dense; of a partly masked one, 1-D at its Coords. The gradient hooks it
    registers on partly masked tensors live until `close()`. With `model`, a partly masked weight
    that several nn.Linear / nn.Embedding modules share (a tied embedding) has each use folded as
    its gradient is computed (_fold_shared_uses), also until `close()`.
    """

    def __init__(
        self,
        params: list[Param],
        kind: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.0,
        model: torch.nn.Module | None = None,
    ):
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer: got {kind!r}; accepted: {', '.join(OPTIMIZERS)}")
        self.params = params
        self.kind, self.lr, self.wd = kind, lr, weight_decay
        self.betas, self.eps, self.momentum = betas, eps, momentum
        self.t = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(_folder(c))
                       for _, p, c in params if c is not None]
        self._patched = _fold_shared_uses(params, model)

    def close(self) -> None:
        """Remove the gradient-folding hooks and the shared-weight patches (the parameters are
        left as they are)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for m in self._patched:
            del m.forward  # back to the class's forward
        self._patched = []

    def zero_grad(self) -> None:
        for _, p, c in self.params:
            p.grad = None
            if c is not None:
                c.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        mask_gradients(self.params)  # a gradient that reached .grad without the hook
        dense = [(n, p, p.grad) for n, p, c in self.params if c is None and p.grad is not None]
        full = [(n, p, g) for n, p, g in dense if p.dtype == torch.float32]
        low = [(n, p, g) for n, p, g in dense if p.dtype != torch.float32]
        if self.kind == "adamw":
            self._adamw_foreach([n for n, _p, _g in full], [p for _, p, _g in full], [g for _, _p, g in full])
        else:
            for name, p, g in full:
                self._sgd(name, p, g)
        # Low-precision weights (precision 'bf16'): float32 optimizer state and update, then the
        # weight is written back rounded, round(w - update): an update below half an ULP of w is
        # lost.
        if low:
            p32 = [p.detach().float() for _, p, _g in low]
            g32 = [g.float() for _, _p, g in low]
            names = [n for n, _p, _g in low]
            if self.kind == "adamw":
                self._adamw_foreach(names, p32, g32)
            else:
                for name, w, g in zip(names, p32, g32, strict=True):
                    self._sgd(name, w, g)
            for (_, p, _g), w in zip(low, p32, strict=True):
                p.copy_(w)
        # Partly masked tensors, one at a time: gather the trainable weights (float32), update,
        # write back at idx only (rounded to the weight's dtype).
        for name, p, c in self.params:
            if c is None or c.grad is None:
                continue
            flat = p.data.view(-1)
            w = flat.index_select(0, c.idx).float()
            if self.kind == "adamw":
                self._adamw_foreach([name], [w], [c.grad])
            else:
                self._sgd(name, w, c.grad)
            flat.index_put_((c.idx,), w.to(p.dtype))

    def _adamw_foreach(self, names: list[str], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """AdamW over the tensors at once (torch._foreach_*); state created as zeros on first use.
        `params` are updated in place (the weights, or float32 gathers of them)."""
        if not params:
            return
        for n, p in zip(names, params, strict=True):
            if n not in self.state:
                self.state[n] = {"exp_avg": torch.zeros_like(p, dtype=torch.float32),
                                 "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
        m1 = [self.state[n]["exp_avg"] for n in names]
        m2 = [self.state[n]["exp_avg_sq"] for n in names]
        b1, b2 = self.betas
        torch._foreach_mul_(m1, b1)
        torch._foreach_add_(m1, grads, alpha=1 - b1)
        torch._foreach_mul_(m2, b2)
        torch._foreach_addcmul_(m2, grads, grads, value=1 - b2)
        bc1 = 1 - b1**self.t
        bc2 = 1 - b2**self.t
        denom = torch._foreach_sqrt(m2)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, self.eps)
        updates = torch._foreach_div(m1, denom)
        del denom
        torch._foreach_mul_(updates, self.lr / bc1)
        if self.wd:  # decoupled decay, on the trained coordinates only
            torch._foreach_add_(updates, params, alpha=self.lr * self.wd)
        torch._foreach_sub_(params, updates)

    def _sgd(self, name: str, p: torch.Tensor, g: torch.Tensor) -> None:
        if self.wd:
            g = g.add(p, alpha=self.wd)
        if self.momentum:
            st = self.state.get(name)
            if st is None:
                st = self.state[name] = {"momentum": g.clone()}
            else:
                st["momentum"].mul_(self.momentum).add_(g)
            g = st["momentum"]
        p.sub_(g * self.lr)


def _folder(c: Coords):  # type: ignore[no-untyped-def]
    """The post-accumulate-grad hook of a partly masked tensor: fold .grad onto c, free it."""

    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            c.fold(p.grad)
            p.grad = None

    return hook


class _FoldUse(torch.autograd.Function):
    """Identity on a weight in one of its uses; the backward folds that use's gradient onto the
    Coords and passes nothing on (the weight's .grad is never built from this use)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, c: Coords) -> torch.Tensor:  # type: ignore[override]
        ctx.coords = c
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        ctx.coords.fold(grad)
        return None, None


def _fold_shared_uses(params: list[Param], model: torch.nn.Module | None) -> list[torch.nn.Module]:
    """A partly masked weight shared by several modules (a tied input/output embedding) gets its
    gradient from each use; autograd keeps the first use's dense gradient until the last one
    arrives and adds them, so two or three dense copies are alive before the post-accumulate hook
    can fold them (issue 30: 6 bytes/param of a small model with a 49,152-row vocabulary). Each use
    by an nn.Linear or nn.Embedding is patched to fold its own gradient as soon as it is computed
    (_FoldUse); returns the patched modules (MaskedOptimizer.close restores them). A weight with
    another kind of user, or a module whose forward is already patched, is left to the hook."""
    coords = {id(p): c for _, p, c in params if c is not None}
    if not coords or model is None:
        return []
    users: dict[int, list[torch.nn.Module]] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None and id(p) in coords and all(u is not mod for u in users.get(id(p), [])):
                users.setdefault(id(p), []).append(mod)
    out: list[torch.nn.Module] = []
    for pid, mods in users.items():
        if len(mods) < 2 or not all(type(m) in (torch.nn.Linear, torch.nn.Embedding) and "forward" not in vars(m)
                                    for m in mods):
            continue
        for m in mods:
            m.forward = _folding_forward(m, coords[pid])  # type: ignore[method-assign]
            out.append(m)
    return out


def _folding_forward(m: torch.nn.Module, c: Coords):  # type: ignore[no-untyped-def]
    import torch.nn.functional as F

    if isinstance(m, torch.nn.Linear):
        lin = m

        def linear(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, _FoldUse.apply(lin.weight, c), lin.bias)

        return linear
    emb = m
    assert isinstance(emb, torch.nn.Embedding)

    def embedding(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, _FoldUse.apply(emb.weight, c), emb.padding_idx, emb.max_norm,
                           emb.norm_type, emb.scale_grad_by_freq, emb.sparse)

    return embedding


def clip_grad_norm(params: list[Param], max_norm: float | None) -> float:
    """Global L2 norm of the trainable coordinates' gradients (dense .grad of dense tensors, the
    folded buffers of partly masked ones); all scaled down to max_norm if above."""
    mask_gradients(params)
    grads = [g for _, g, _c in grads_of(params)]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)]))
    if max_norm is not None:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for dt in {g.dtype for g in grads}:
            torch._foreach_mul_([g for g in grads if g.dtype == dt], scale.to(dt))
    return float(norm)
