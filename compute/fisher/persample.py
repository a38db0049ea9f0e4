"""Per-row gradient maths of one module call, as pure functions of tensors.

Each function takes a module call's saved input x (or ids) and its output gradient g, one row
per sample on dim 0, and returns per-row gradients or their sum of squares over the rows:

  nn.Linear        G_n = g_n^T x_n          (out, in)      x (B, T, in), g (B, T, out)
  Conv1D (GPT-2)   G_n = x_n^T g_n          (in, out)
  rank-1 rows      a row whose g is non-zero at one position t only (the `token` estimator's
                   head and last block): sum_n G_n^2 = (g_t^2)^T (x_t^2), one matmul
  bias             b_n = sum_t g_{n,t}      (out,)
  nn.Embedding     G_n[v] = scale * sum_{t: id_{n,t} = v} g_{n,t}   (scaled: Gemma, XGLM)
  affine           modules elementwise-affine in 1-D parameters q over the last dim (RMSNorm,
                   LayerNorm, q_norm): grad_q = sum_t g * (f(q=1) - f(q=0))
  anything else    vmap over rows of vjp(functional_call(module))

Nothing here keeps state or touches hooks: `accumulate` routes module calls to these functions
and adds the results per group. Inputs in half precision are widened to float32 (`wide`);
float64 stays float64, so the float64 reference tests run the same code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from compute.lm.device import wide

# per-row gradients of at most this many elements in total are formed in one batched op; larger
# ones one row at a time into a reused buffer (no (B, out, in) temporary)
SMALL_BATCHED = 1 << 20
# the block of a weight's square sum kept in the CPU's cache (linear_square_sum): 4 MiB, from a
# sweep of 512 KiB - 8 MiB on nine Llama-like shapes (benchmarks/bench_square_blocks.py
# --sweep-kib, bench_square_blocks_sweep.json, session 18): summed over the shapes, time over one
# batched product 18.5 -> 16.2 on one thread and 45.8 -> 25.6 on two (512 KiB blocks: a block and
# its row buffer outgrew the core's half-MiB L2 anyway, and two threads split a small block badly)
CPU_BLOCK_BYTES = 4 << 20


def is_conv1d(module: nn.Module) -> bool:
    """transformers.pytorch_utils.Conv1D (GPT-2), recognised without importing transformers."""
    w = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and \
        isinstance(w, torch.Tensor) and w.dim() == 2


def square_sum(grads: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """sum_n grads[n]^2 -> (*shape), a fresh tensor. grads (B, *shape).

    in_place=True squares `grads` itself (a buffer about to be dropped): no (B, *shape) copy."""
    if in_place:
        return grads.square_().sum(0)
    if grads.numel() <= SMALL_BATCHED or grads.shape[0] == 1:
        return grads.square().sum(0)
    out = grads[0].square()
    for i in range(1, grads.shape[0]):
        out.addcmul_(grads[i], grads[i])
    return out


# --------------------------------------------------------------------------------------------
# Linear / Conv1D
# --------------------------------------------------------------------------------------------


# values of |g| per slice when looking for a gradient's non-zero positions (nonzero_positions)
SPAN_CHUNK = 1 << 20
# a linear weight's per-row products skip each row's zero positions at either end (positions)
# when that leaves at most this share of the batch's positions: the output head and the
# position-wise modules after the last attention have a zero gradient at every prompt position
# (and every module at padding). Measured on the head's shape (16 rows x 20 positions, 8,192 x
# 384, 35% of the positions zero; a one-off timing, not committed): its square sum 32.6 -> 25.1 ms;
# at small K a per-row product's time is mostly its output, so a few positions less saves little.
# The whole pass: benchmarks/ab_session22.py (session 22).
SPAN_KEEP_MAX = 0.85


def nonzero_positions(g: torch.Tensor) -> torch.Tensor:
    """(..., T) whether each position of g (..., T, out) holds a non-zero value (NaN counts as
    non-zero): |g|'s maximum over the last dim, a slice of positions at a time (temporaries of at
    most SPAN_CHUNK values; 10x faster than vector_norm(ord=inf) on a CPU, a one-off timing on the head's
    gradient: 0.73 against 6.9 ms)."""
    flat = g.reshape(-1, g.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.bool, device=g.device)
    step = max(1, SPAN_CHUNK // max(1, flat.shape[1]))
    for r0 in range(0, flat.shape[0], step):
        torch.ne(flat[r0:r0 + step].abs().amax(-1), 0, out=out[r0:r0 + step])
    return out.reshape(g.shape[:-1])


def positions(g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(single, spans) for a linear's output gradient g (B, T, out):

    single: (B,) the one position where each row's g is non-zero, or None
    when some row has several (rows with none get position 0: their gradient is zero anyway);
    spans: (B, 2) [first, last + 1) of each row's non-zero positions (a row with none: an empty
    span), when skipping the zero positions at the rows' ends leaves at most SPAN_KEEP_MAX of the
    B x T positions; else None. Looked for only when row 0 (the engine sorts rows longest first)
    has at most one non-zero position or a zero one at either end: one scan of row 0 otherwise."""
    B, T = g.shape[0], g.shape[1]
    if T == 1:
        return torch.zeros(B, dtype=torch.long, device=g.device), None
    nz0 = nonzero_positions(g[0])
    one = int(nz0.sum()) <= 1
    if not one and bool(nz0[0]) and bool(nz0[-1]):  # the usual case: nothing to skip
        return None, None
    nz = torch.cat([nz0[None], nonzero_positions(g[1:])])  # (B, T): row 0's scan is done
    if one and not bool((nz.sum(1) > 1).any()):
        return nz.to(torch.uint8).argmax(1), None
    ar = torch.arange(T, device=g.device)
    first = torch.where(nz, ar, T).amin(1)
    last = torch.maximum(torch.where(nz, ar, -1).amax(1) + 1, first)  # a row with none: (T, T)
    spans = torch.stack([first, last], 1)
    return None, (spans if int((last - first).sum()) <= SPAN_KEEP_MAX * B * T else None)


def _at(x: torch.Tensor, g: torch.Tensor, pos: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """x, g restricted to position pos[n] of each row: (B, 1, in), (B, 1, out)."""
    if pos is None:
        return x, g
    ar = torch.arange(g.shape[0], device=g.device)
    return x[ar, pos].unsqueeze(1), g[ar, pos].unsqueeze(1)


def linear_row_grads(*, x: torch.Tensor, g: torch.Tensor, conv1d: bool = False,
                     pos: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     ) -> torch.Tensor:
    """Per-row weight gradients (B, out, in) (Conv1D: (B, in, out)); x (B, T, in), g (B, T, out).

    pos: the rows' single non-zero positions (`positions`), or None. out: add into this
    (B, ...) tensor in place (a shared parameter's per-row buffer) instead of a new one."""
    x, g = _at(x, g, pos)
    a, b = (g.transpose(1, 2), x) if not conv1d else (x.transpose(1, 2), g)
    if out is None:
        return torch.bmm(a, b)
    return out.baddbmm_(a, b)


def linear_grad_sum(*, x: torch.Tensor, g: torch.Tensor, conv1d: bool = False) -> torch.Tensor:
    """sum_n G_n: the batch gradient of the weight (out, in) (Conv1D: (in, out))."""
    xf, gf = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])  # (B*T, in), (B*T, out)
    return gf.T @ xf if not conv1d else xf.T @ gf


def linear_rank1_square_sum(*, x: torch.Tensor, g: torch.Tensor, pos: torch.Tensor,
                            conv1d: bool = False) -> torch.Tensor:
    """sum_n G_n^2 when row n's g is non-zero at position pos[n] only: G_n = g_n x_n^T is rank 1,
    so G_n^2 = (g_n^2)(x_n^2)^T and the sum over rows is one matmul (out, in)."""
    xs, gs = _at(x, g, pos)
    x2, g2 = xs[:, 0].square(), gs[:, 0].square()  # (B, in), (B, out)
    return g2.T @ x2 if not conv1d else x2.T @ g2


def linear_square_sum(*, x: torch.Tensor, g: torch.Tensor, conv1d: bool = False,
                      pos: torch.Tensor | None = None, spans: torch.Tensor | None = None) -> torch.Tensor:
    """sum_n G_n^2 (out, in) (Conv1D: (in, out)); x (B, T, in), g (B, T, out).

    Rank-1 rows (pos given) take one matmul; small weights one batched matmul; large ones one row
    at a time into a reused buffer, squared straight into the sum (each G_n read once), each row's
    product over its span of positions only when `spans` ((B, 2) [first, last + 1), `positions`)
    is given: g is zero outside it, so the sum is the same."""
    if pos is not None:
        return linear_rank1_square_sum(x=x, g=g, pos=pos, conv1d=conv1d)
    B = g.shape[0]
    if B * x.shape[-1] * g.shape[-1] <= SMALL_BATCHED:
        return linear_row_grads(x=x, g=g, conv1d=conv1d).square_().sum(0)  # fresh: in place
    a, b = (g.transpose(1, 2), x) if not conv1d else (x.transpose(1, 2), g)
    rows = a.shape[1]
    # on a CPU, a block of output rows at a time that stays in the core's cache while every
    # row's gradient is squared into it (issue 30: 25-30% less time than whole-weight
    # products, whose (out, in) result goes through memory once per row; benchmarks/bench_scale.py)
    step = max(1, CPU_BLOCK_BYTES // (g.element_size() * b.shape[2])) if g.device.type == "cpu" else rows
    # (row, first, last + 1) of the positions each row's product runs over; rows with none left out
    runs = [(i, 0, b.shape[1]) for i in range(B)] if spans is None else \
        [(i, s, e) for i, (s, e) in enumerate(spans.tolist()) if e > s]
    out = torch.empty((rows, b.shape[2]), dtype=g.dtype, device=g.device)
    if not runs:  # every row's gradient is zero
        return out.zero_()
    buf = torch.empty((min(step, rows), b.shape[2]), dtype=g.dtype, device=g.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        ob, bb = out[r0:r1], buf[:r1 - r0]
        i, s, e = runs[0]
        torch.mm(a[i, r0:r1, s:e], b[i, s:e], out=ob)
        ob.square_()
        for i, s, e in runs[1:]:
            torch.mm(a[i, r0:r1, s:e], b[i, s:e], out=bb)
            ob.addcmul_(bb, bb)
    return out


def bias_row_grads(*, g: torch.Tensor) -> torch.Tensor:
    """Per-row bias gradients (B, out) from g (B, ..., out)."""
    return g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)


# --------------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------------


def embedding_row_grads(*, ids: torch.Tensor, g: torch.Tensor, num_embeddings: int,
                        scale: float = 1.0, padding_idx: int | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The non-zero rows of every per-row embedding gradient, sparse: (row, vocab, grad).

    ids (B, T) long, g (B, T, d) the gradient of the embedding module's output; scale = d out /
    d lookup (Gemma's embed_scale). Returns row (U,), vocab (U,) long and grad (U, d) with one
    entry per distinct (row, token) pair: G_row[vocab] = grad. The padding_idx row is always 0."""
    B, V = g.shape[0], num_embeddings
    ids = ids.reshape(B, -1)  # (B, T)
    gf = g.reshape(B, ids.shape[1], -1)  # (B, T, d)
    if scale != 1.0:
        gf = gf * scale
    if padding_idx is not None:  # that row's gradient is always zero
        gf = gf * (ids != padding_idx).unsqueeze(-1)
    row = torch.arange(B, device=ids.device).unsqueeze(1).expand_as(ids)
    key = (row * V + ids).reshape(-1)  # (B*T,)
    uniq, inv = torch.unique(key, return_inverse=True)
    grad = torch.zeros((uniq.numel(), gf.shape[-1]), dtype=gf.dtype, device=gf.device)
    grad.index_add_(0, inv, gf.reshape(-1, gf.shape[-1]))
    return uniq // V, uniq % V, grad


# --------------------------------------------------------------------------------------------
# Elementwise-affine modules and the generic path (both re-run the module)
# --------------------------------------------------------------------------------------------


def _wide_all(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def one(t: Any) -> Any:
        return wide(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return tuple(one(t) for t in args), {k: one(v) for k, v in kwargs.items()}


def affine_row_grads(*, module: nn.Module, params: list[str], args: tuple, kwargs: dict,
                     g: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Per-row grads (B, d) for a module elementwise-affine in its 1-D parameters `params` over
    the last dim: output = base + q * slope_q, so grad_q = sum over positions of g * slope_q with
    slope_q = f(q=1, others 0) - f(all 0). None when a parameter is not 1-D of size d. The
    affine assumption is not checked here (the caller verifies it once against the generic path)."""
    from torch.func import functional_call

    d = g.shape[-1]
    if not all(getattr(module, k).dim() == 1 and getattr(module, k).shape[0] == d for k in params):
        return None
    gf = wide(g)
    a, kw = _wide_all(args, kwargs)
    zeros = {k: torch.zeros(d, dtype=gf.dtype, device=g.device) for k in params}
    out = {}
    with torch.no_grad():
        base = functional_call(module, zeros, a, kw)
        for k in params:
            p = dict(zeros)
            p[k] = torch.ones(d, dtype=gf.dtype, device=g.device)
            slope = functional_call(module, p, a, kw) - base  # (B, ..., d)
            out[k] = (gf * slope).reshape(g.shape[0], -1, d).sum(1)  # (B, d)
    return out


def _unsq(t: Any) -> Any:
    return t.unsqueeze(0) if isinstance(t, torch.Tensor) else t


def generic_row_grads(*, module: nn.Module, params: list[str], args: tuple, kwargs: dict,
                      g: torch.Tensor, rows_per_chunk: int,
                      ) -> Iterator[tuple[slice, dict[str, torch.Tensor]]]:
    """Exact per-row gradients of any module: vmap over rows of vjp(functional_call).

    Yields (rows, {param: (b, *shape)}) for chunks of at most rows_per_chunk rows. Tensor
    arguments with B rows on dim 0 are split per row; other arguments are shared."""
    from torch.func import functional_call, vjp, vmap

    B = g.shape[0]
    weights = {k: wide(getattr(module, k).detach()) for k in params}
    keys = list(kwargs)
    a, kw = _wide_all(args, kwargs)
    flat = list(a) + [kw[k] for k in keys]
    in_dims = tuple(0 if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == B
                    else None for t in flat)
    n_args = len(args)

    def one_row(gr: torch.Tensor, *row_flat: Any) -> dict[str, torch.Tensor]:
        ra = tuple(row_flat[:n_args])
        rkw = dict(zip(keys, row_flat[n_args:], strict=True))

        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            # the row has no batch dim now: add it back for modules that expect one
            out = functional_call(module, p, tuple(_unsq(t) for t in ra),
                                  {k: _unsq(v) for k, v in rkw.items()})
            return out.squeeze(0)

        _, pull = vjp(f, weights)[:2]
        return pull(wide(gr))[0]

    for s in range(0, B, max(1, rows_per_chunk)):
        rows = slice(s, min(B, s + max(1, rows_per_chunk)))
        chunk = [t[rows] if d == 0 else t for t, d in zip(flat, in_dims, strict=True)]
        yield rows, vmap(one_row, in_dims=(0, *in_dims))(g[rows], *chunk)
