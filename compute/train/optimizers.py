"""The mask-aware optimizer (AdamW, SGD) and training precision.

A fixed mask (name -> bool tensor, True = trainable) freezes every excluded coordinate
completely. `MaskedOptimizer` is our own AdamW/SGD step, written so that frozen coordinates stay
bit-identical:
- gradients are multiplied by the mask right after backward, before clipping (so the clip norm
  only sees trainable coordinates) and before the optimizer;
- Adam moments start at 0 and only ever receive masked gradients, so they stay exactly 0 off
  the mask; the Adam update there is 0 / (sqrt(0) + eps) = 0 exactly;
- decoupled weight decay is applied as lr * wd * p * mask (torch's AdamW multiplies the whole
  tensor by 1 - lr * wd, which would shrink frozen weights); SGD's coupled decay wd * p is
  likewise masked before it enters the momentum buffer;
- the weight is changed by p -= update with update exactly 0 (+0.0) off the mask, and x - 0.0 == x
  bit for bit for every finite x (including -0.0).
Tensors entirely outside the mask get requires_grad = False (no gradient is computed for them);
tensors entirely inside carry no mask (no extra work).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from compute.train.config import OPTIMIZERS, PRECISIONS

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


def prepare_masked_params(
    model: torch.nn.Module, mask: Mapping[str, torch.Tensor] | None
) -> list[tuple[str, torch.nn.Parameter, torch.Tensor | None]]:
    """(name, param, float mask or None) for each parameter that will train.

    With a mask: names must be parameters of the model with matching shapes (ValueError naming the
    first mismatch); parameters absent from the mask or with an all-False mask are frozen by
    requires_grad = False; an all-True mask is stored as None (dense). Without a mask: all
    parameters, dense.
    """
    named = dict(model.named_parameters())
    if mask is None:
        for p in named.values():
            p.requires_grad_(True)
        return [(n, p, None) for n, p in named.items()]
    for n, m in mask.items():
        if n not in named:
            raise ValueError(f"mask: parameter {n!r} is not a parameter of the model")
        if tuple(m.shape) != tuple(named[n].shape):
            raise ValueError(
                f"mask: parameter {n!r} has shape {list(m.shape)} in the mask "
                f"but {list(named[n].shape)} in the model"
            )
    out = []
    for n, p in named.items():
        given = mask.get(n)
        if given is None or not bool(given.any()):
            p.requires_grad_(False)
            continue
        p.requires_grad_(True)
        mf = None if bool(given.all()) else given.to(device=p.device, dtype=p.dtype)
        out.append((n, p, mf))
    if not out:
        raise ValueError("mask: selects no coordinate of the model; nothing would train")
    return out


def mask_gradients(params: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]]) -> None:
    """Zero the gradient off the mask, in place (call after backward, before clipping)."""
    for _, p, m in params:
        if m is not None and p.grad is not None:
            p.grad.mul_(m)


class MaskedOptimizer:
    """AdamW or SGD whose step never changes a masked-out coordinate (see the module docstring).

    AdamW matches torch.optim.AdamW (decoupled decay, bias correction) on the mask; SGD matches
    torch.optim.SGD (coupled decay, momentum buffer b = mu * b + g, no dampening).
    """

    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]],
        kind: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.0,
    ):
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer: got {kind!r}; accepted: {', '.join(OPTIMIZERS)}")
        self.params = params
        self.kind, self.lr, self.wd = kind, lr, weight_decay
        self.betas, self.eps, self.momentum = betas, eps, momentum
        self.t = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        for _, p, _m in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        live = [(n, p, g, m) for n, p, m in self.params if (g := p.grad) is not None]
        full = [(n, p, g, m) for n, p, g, m in live if p.dtype == torch.float32]
        low = [(n, p, g, m) for n, p, g, m in live if p.dtype != torch.float32]
        if self.kind == "adamw":
            self._adamw_foreach([n for n, _p, _g, _m in full], [p for _, p, _g, _m in full],
                                [g for _, _p, g, _m in full], [m for _, _p, _g, m in full])
        else:
            for name, p, g, m in full:
                # re-mask: the invariant holds even if the caller forgot mask_gradients
                self._sgd(name, p, g if m is None else g * m, m)
        # Low-precision weights (precision 'bf16'): float32 optimizer state and update, then the
        # weight is written back rounded, round(w - update): an update below half an ULP of w is
        # lost. Off the mask the update is exactly 0, and bf16 -> float32 -> bf16 is exact.
        if low:
            p32 = [p.detach().float() for _, p, _g, _m in low]
            g32 = [g.float() for _, _p, g, _m in low]
            m32 = [None if m is None else m.float() for _, _p, _g, m in low]
            names = [n for n, _p, _g, _m in low]
            if self.kind == "adamw":
                self._adamw_foreach(names, p32, g32, m32)
            else:
                for name, w, g, m in zip(names, p32, g32, m32, strict=True):
                    self._sgd(name, w, g if m is None else g * m, m)
            for (_, p, _g, _m), w in zip(low, p32, strict=True):
                p.copy_(w)

    def _adamw_foreach(self, names: list[str], params: list[torch.Tensor], grads: list[torch.Tensor],
                       masks: list[torch.Tensor | None]) -> None:
        """AdamW over all tensors at once (torch._foreach_*); state created as zeros on first use."""
        if not params:
            return
        for n, p in zip(names, params, strict=True):
            if n not in self.state:
                self.state[n] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        grads = list(grads)
        masked = [i for i, m in enumerate(masks) if m is not None]
        mask_of = [m for m in masks if m is not None]  # the masks of `masked`, in order
        if masked:  # re-mask: the invariant holds even if the caller forgot mask_gradients
            gm = torch._foreach_mul([grads[i] for i in masked], mask_of)
            for i, g in zip(masked, gm, strict=True):
                grads[i] = g
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
        updates = torch._foreach_div(m1, denom)  # exactly 0 off the mask
        torch._foreach_mul_(updates, self.lr / bc1)
        if self.wd:
            dense = [i for i, m in enumerate(masks) if m is None]
            if dense:
                torch._foreach_add_([updates[i] for i in dense], [params[i] for i in dense],
                                    alpha=self.lr * self.wd)
            if masked:  # decoupled decay only on the mask
                torch._foreach_addcmul_([updates[i] for i in masked], [params[i] for i in masked],
                                        mask_of, value=self.lr * self.wd)
        torch._foreach_sub_(params, updates)

    def _sgd(self, name: str, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None) -> None:
        if self.wd:
            g = g.add(p if m is None else p * m, alpha=self.wd)
        if self.momentum:
            st = self.state.get(name)
            if st is None:
                st = self.state[name] = {"momentum": g.clone()}
            else:
                st["momentum"].mul_(self.momentum).add_(g)
            g = st["momentum"]
        p.sub_(g * self.lr)


def clip_grad_norm(
    params: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]], max_norm: float | None
) -> float:
    """Global L2 norm of the (already masked) gradients; scaled down to max_norm if above."""
    grads = [p.grad for _, p, _m in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)]))
    if max_norm is not None:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return float(norm)
