"""The mask-aware optimizer (AdamW, SGD) and training precision.

A fixed mask (name -> bool tensor, True = trainable) freezes every excluded coordinate
completely. `MaskedOptimizer` is our own AdamW/SGD step whose memory is in proportion to the
mask (issue 30) and whose frozen coordinates stay bit-identical:
- a partly trainable tensor is described by `Coords`: the flat indices of its trainable
  coordinates (int32 where the tensor has < 2^31 elements), nothing dense;
- its gradient is folded as it arrives into a float32 buffer of the mask's size (adding to it
  over micro-batches): the weight of an nn.Linear / nn.Embedding computes only what the mask
  needs (a block of output rows at a time; an embedding's looked-up rows), never a dense
  gradient; any other tensor's .grad is gathered and freed by a post-accumulate-grad hook, so
  at most one such dense gradient is alive at a time;
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
from collections.abc import Callable, Mapping
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

    def _buffer(self, device: torch.device) -> torch.Tensor:
        if self.grad is None:
            self.grad = torch.zeros(self.count, dtype=torch.float32, device=device)
        return self.grad

    def fold_row_blocks(self, rows: int, cols: int, block: Callable[[int, int], torch.Tensor]) -> None:
        """Add the gradient of a (rows, cols) weight at idx, given a block of its rows at a time:
        `block(a, b)` is rows a..b-1 of the dense gradient. A block holding no trainable
        coordinate is never computed; at most FOLD_BLOCK_BYTES of float32 rows are alive."""
        from compute.contract.cost import FOLD_BLOCK_BYTES

        step = max(1, FOLD_BLOCK_BYTES // (4 * max(cols, 1)))
        starts = list(range(0, rows, step)) + [rows]
        edges = torch.tensor([a * cols for a in starts], dtype=self.idx.dtype, device=self.idx.device)
        bounds = torch.searchsorted(self.idx, edges).tolist()
        for k in range(len(starts) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            if hi == lo:
                continue
            g = block(starts[k], starts[k + 1])
            at = self.idx[lo:hi] - starts[k] * cols
            self._buffer(g.device)[lo:hi] += g.reshape(-1).index_select(0, at).float()

    def fold_rows(self, row_ids: torch.Tensor, rows: torch.Tensor, cols: int) -> None:
        """Add the gradient of a (_, cols) weight that is zero outside the sorted, distinct rows
        `row_ids`, whose values are `rows` (len(row_ids), cols): an embedding's gradient, only
        the looked-up rows, never the whole table."""
        buf = self._buffer(rows.device)
        idx = self.idx
        first = (row_ids * cols).to(idx.dtype)
        start = torch.searchsorted(idx, first)
        count = torch.searchsorted(idx, first + cols) - start
        total = int(count.sum())
        if total == 0:
            return
        owner = torch.repeat_interleave(torch.arange(len(row_ids), device=idx.device), count)
        offset = torch.repeat_interleave(start - (torch.cumsum(count, 0) - count), count)
        pos = torch.arange(total, device=idx.device) + offset
        col = idx.index_select(0, pos) - first.index_select(0, owner)
        buf.index_add_(0, pos, rows[owner, col.long()].float())

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
    registers on partly masked tensors live until `close()`. With `model`, every use of a partly
    masked weight by an nn.Linear / nn.Embedding (a tied embedding's two included) folds its
    gradient as it is computed, without a dense one (_fold_uses), also until `close()`.
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
        self._patched = _fold_uses(params, model)

    def close(self) -> None:
        """Remove the gradient-folding hooks and the shared-weight patches (the parameters are
        left as they are)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for m, cls in self._patched:
            m.__class__ = cls  # back to the module's own class
            del m._fold_coords
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


class _LinearFold(torch.autograd.Function):
    """F.linear whose weight gradient is folded onto the weight's Coords a block of output rows
    at a time (Coords.fold_row_blocks) and never built whole; the input's and the bias's
    gradients as F.linear's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,  # type: ignore[override]
                c: Coords) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.coords, ctx.has_bias = c, b is not None
        return torch.nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            ctx.coords.fold_row_blocks(w.shape[0], w.shape[1], lambda a, b: dy2[:, a:b].t() @ x2)
        return dx, None, db, None


class _EmbeddingFold(torch.autograd.Function):
    """F.embedding whose weight gradient is folded onto the weight's Coords from the looked-up
    rows alone (Coords.fold_rows): the table-sized gradient is never built."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, w: torch.Tensor, c: Coords,  # type: ignore[override]
                padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.coords, ctx.padding_idx, ctx.cols = c, padding_idx, w.shape[1]
        return torch.nn.functional.embedding(ids, w, padding_idx)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[None, None, None, None]:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            uniq, inv = torch.unique(ids.reshape(-1), return_inverse=True)
            rows = torch.zeros(len(uniq), ctx.cols, dtype=dy.dtype, device=dy.device)
            rows.index_add_(0, inv, dy.reshape(-1, ctx.cols))
            if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
                rows[uniq == ctx.padding_idx] = 0
            ctx.coords.fold_rows(uniq, rows, ctx.cols)
        return None, None, None, None


class _FoldingLinear(torch.nn.Linear):
    """nn.Linear whose weight's use folds its gradient (_LinearFold); `_fold_coords` is set on
    the instance by _fold_uses."""

    _fold_coords: Coords

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFold.apply(x, self.weight, self.bias, self._fold_coords)  # type: ignore[no-any-return]


class _FoldingEmbedding(torch.nn.Embedding):
    """nn.Embedding whose weight's use folds its gradient (_EmbeddingFold)."""

    _fold_coords: Coords

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _EmbeddingFold.apply(ids, self.weight, self._fold_coords, self.padding_idx)  # type: ignore[no-any-return]


_FOLDING_CLASSES: dict[type, type] = {torch.nn.Linear: _FoldingLinear, torch.nn.Embedding: _FoldingEmbedding}


_SUBCLASSES: dict[type, type] = {}  # one folding class per subclass


def _folding_class(cls: type) -> type | None:
    """The class a module of class `cls` takes while its weight's uses fold: the folding class
    itself for nn.Linear / nn.Embedding, and for a subclass (Gemma's scaled embedding) the
    subclass over it, so that the subclass's super().forward() is the folding one (a subclass
    that computes its own forward without it keeps autograd's gradient, and the hook folds it).
    """
    for base, folding in _FOLDING_CLASSES.items():
        if cls is base:
            return folding
        if issubclass(cls, base) and not issubclass(cls, folding):
            if cls not in _SUBCLASSES:
                _SUBCLASSES[cls] = type(f"Folding{cls.__name__}", (cls, folding), {"__module__": __name__})
            return _SUBCLASSES[cls]
    return None


def _foldable(mod: torch.nn.Module) -> bool:
    if "forward" in vars(mod):  # an instance forward set by someone else (accelerate's hooks)
        return False
    if isinstance(mod, torch.nn.Embedding):  # the options _EmbeddingFold does not reproduce
        return mod.max_norm is None and not mod.scale_grad_by_freq and not mod.sparse
    return isinstance(mod, torch.nn.Linear)


def _fold_uses(params: list[Param], model: torch.nn.Module | None) -> list[tuple[torch.nn.Module, type]]:
    """Every use of a partly masked weight by an nn.Linear or nn.Embedding (a subclass included)
    folds its own gradient onto the weight's Coords as it is computed, without a dense gradient
    (issue 30): a linear layer's a block of rows at a time, an embedding's from its looked-up
    rows. Before, autograd built the dense gradient of each use (and of a tied embedding kept
    the first use's until the last arrived): the largest tensor's, the masked run's peak at 20M
    parameters. A weight with another kind of user, or a module already patched, is left to the
    post-accumulate hook (same sums). Returns (module, its class) to restore (MaskedOptimizer.close)."""
    coords = {id(p): c for _, p, c in params if c is not None}
    if not coords or model is None:
        return []
    users: dict[int, list[torch.nn.Module]] = {}
    others: set[int] = set()
    for _, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is None or id(p) not in coords:
                continue
            if pname != "weight" or not _foldable(mod) or _folding_class(type(mod)) is None:
                others.add(id(p))
            elif all(u is not mod for u in users.get(id(p), [])):
                users.setdefault(id(p), []).append(mod)
    out: list[tuple[torch.nn.Module, type]] = []
    for pid, mods in users.items():
        if pid in others:  # some use would build the dense gradient anyway: leave all to the hook
            continue
        for m in mods:
            cls = type(m)
            m.__class__ = _folding_class(cls)  # type: ignore[assignment]
            m._fold_coords = coords[pid]  # type: ignore[assignment]
            out.append((m, cls))
    return out


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
