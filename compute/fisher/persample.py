"""Per-row gradient maths of one module call: from its saved input x and output gradient g.

  nn.Linear        G_n = g_n^T x_n          (out, in)   batched matmul per row, chunked
  Conv1D (GPT-2)   G_n = x_n^T g_n          (in, out)
  rank-1 rows      when a row's g is non-zero at one position only (the `token` estimator's
                   head and last block): sum_n G_n^2 = (g^2)^T (x^2), one matmul per group
  nn.Embedding     G_n[v] = sum_{t: id_t = v} g_{n,t} x scale   (scaled embeddings: Gemma, XGLM)
  affine norms     grad_q = sum_t g * (f(q=1) - f(0))  (RMSNorm, LayerNorm, q_norm; verified once)
  anything else    vmap over rows of vjp(functional_call(module))

`Store` keeps the per-group sums of squares (the first square of a group is written directly,
no zero-fill) and, while the engine verifies a model, the plain sum of per-row gradients.
`Accumulator` holds one forward pass: groups of its rows, uses of shared parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compute.device import wide

# per-row gradients of at most this many elements in total are formed in one batched op
_SMALL_BATCHED = 1 << 20
# module -> whether its per-row gradients may use the elementwise-affine shortcut (verified once)
_AFFINE_OK: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D without importing transformers here
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


class Store:
    """name -> (n_groups, *shape) sums of squared per-row gradients, kept across passes."""

    def __init__(self, names: dict[int, str], shapes: dict[str, torch.Size], n_groups: int,
                 dtype: torch.dtype, device: torch.device, check: bool = False):
        self.names = names  # id(param) -> name
        self.shapes, self.n_groups, self.dtype, self.device = shapes, n_groups, dtype, device
        self.sums: dict[str, torch.Tensor] = {}
        self.filled: dict[str, list[bool]] = {}
        # sum over rows of the per-row gradients (== the batch gradient when the maths is right)
        self.check: dict[str, torch.Tensor] | None = {} if check else None

    def tensor(self, name: str) -> torch.Tensor:
        t = self.sums.get(name)
        if t is None:
            t = self.sums[name] = torch.empty((self.n_groups, *self.shapes[name]),
                                              dtype=self.dtype, device=self.device)
            self.filled[name] = [False] * self.n_groups
        return t

    def zero_unfilled(self, name: str, groups: list[int] | None = None) -> torch.Tensor:
        """The sums of `name` with the listed (default: all) groups made writable by adding."""
        t = self.tensor(name)
        flags = self.filled[name]
        for k in range(self.n_groups) if groups is None else groups:
            if not flags[k]:
                t[k].zero_()
                flags[k] = True
        return t

    def square_into(self, name: str, k: int, grad: torch.Tensor) -> None:
        """Add grad^2 (one row's whole gradient) to group k."""
        t, flags = self.tensor(name), self.filled[name]
        if flags[k]:
            t[k].addcmul_(grad, grad)
        else:
            torch.mul(grad, grad, out=t[k])
            flags[k] = True

    def mm_into(self, name: str, k: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add a @ b (an already-squared rank-1 sum) to group k."""
        t, flags = self.tensor(name), self.filled[name]
        if flags[k]:
            t[k].addmm_(a, b)
        else:
            torch.mm(a, b, out=t[k])
            flags[k] = True

    def add_check(self, name: str, grad_sum: torch.Tensor) -> None:
        if self.check is not None:
            c = self.check.get(name)
            self.check[name] = grad_sum.to(self.dtype, copy=True) if c is None else c + grad_sum

    def finish(self) -> dict[str, torch.Tensor]:
        """Every parameter's sums; groups (or parameters) no row reached are zero."""
        for name in self.shapes:
            self.zero_unfilled(name)
        return self.sums


class Accumulator:
    """One forward pass: its rows' groups, the uses of each parameter, per-row buffers of shared
    parameters (tied weights: per-row gradients summed over all uses before squaring)."""

    def __init__(self, store: Store, groups: torch.Tensor, budget_bytes: int):
        self.store = store
        self.groups = groups  # (B,) long on the device
        self.groups_cpu: list[int] = groups.tolist()
        self.budget = budget_bytes
        self.uses: dict[str, int] = {}
        self.arrived: dict[str, int] = {}
        self.rows: dict[str, torch.Tensor] = {}
        self.scratch: dict[tuple, torch.Tensor] = {}
        self.recomputing = False  # set while a per-row path re-runs a module (hooks stay quiet)

    @property
    def store_names(self) -> dict[int, str]:
        return self.store.names

    @property
    def dtype(self) -> torch.dtype:
        return self.store.dtype

    def rows_per_chunk(self, numel_per_row: int) -> int:
        return max(1, self.budget // max(1, 4 * 2 * numel_per_row))

    def buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor reused across modules of the same shape (saves page faults)."""
        key = (tuple(shape), dtype)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = torch.empty(shape, dtype=dtype, device=self.groups.device)
        return buf

    def add_squares(self, name: str, rows: slice, grad: torch.Tensor) -> None:
        """grad (b, *shape) per-row gradients of rows `rows`: add their squares per group."""
        st = self.store
        st.add_check(name, grad.sum(0))
        g_rows = self.groups_cpu[rows.start : rows.stop]
        if grad[0].numel() * grad.shape[0] <= _SMALL_BATCHED:
            acc = st.zero_unfilled(name, sorted(set(g_rows)))
            acc.index_add_(0, self.groups[rows], grad.square())
            return
        # one fused multiply-add per row into its group's sum: reads each per-row gradient once
        for i, k in enumerate(g_rows):
            st.square_into(name, k, grad[i])

    def add_row_square(self, name: str, row: int, grad: torch.Tensor) -> None:
        """grad (*shape): the whole gradient of one row (single-use parameter)."""
        self.store.add_check(name, grad)
        self.store.square_into(name, self.groups_cpu[row], grad)

    def row_buffer(self, name: str) -> torch.Tensor:
        """(B, *shape) per-row gradient sums of a shared parameter (zeros on first use)."""
        buf = self.rows.get(name)
        if buf is None:
            B = self.groups.shape[0]
            buf = self.rows[name] = torch.zeros((B, *self.store.shapes[name]), dtype=self.dtype,
                                                device=self.groups.device)
        return buf

    def contribute(self, name: str, rows: slice, grad: torch.Tensor) -> None:
        """Per-row gradient (b, *shape) of one use of a parameter for rows `rows`."""
        if self.uses[name] == 1:
            self.add_squares(name, rows, grad)
            return
        self.row_buffer(name)[rows] += grad

    def use_done(self, name: str) -> None:
        self.arrived[name] = self.arrived.get(name, 0) + 1
        if self.uses[name] > 1 and self.arrived[name] == self.uses[name]:
            self._flush(name)

    def _flush(self, name: str) -> None:
        buf = self.rows.pop(name, None)
        if buf is not None:
            self.add_squares(name, slice(0, buf.shape[0]), buf)

    def finish_pass(self) -> None:
        # uses whose gradient never arrived (outputs not connected to the loss) contribute zero
        for name in list(self.rows):
            self._flush(name)
        self.uses.clear()
        self.arrived.clear()


# --------------------------------------------------------------------------------------------
# Linear / Conv1D
# --------------------------------------------------------------------------------------------


def single_positions(gf: torch.Tensor) -> torch.Tensor | None:
    """(B,) the one position where each row's output gradient is non-zero, or None when some
    row has several (rows with none get position 0: their gradient is zero anyway)."""
    if gf.shape[1] == 1:
        return torch.zeros(gf.shape[0], dtype=torch.long, device=gf.device)
    nz = gf.abs().amax(-1) != 0  # (B, T)
    if bool((nz.sum(1) > 1).any()):
        return None
    return nz.to(torch.uint8).argmax(1)


def linear_rows(acc: Accumulator, mod: nn.Module, local: dict[str, str], x: torch.Tensor,
                g: torch.Tensor) -> None:
    """Per-row gradients of an nn.Linear or Conv1D call; x (B, ..., in), g (B, ..., out)."""
    B = g.shape[0]
    xf = wide(x.reshape(B, -1, x.shape[-1]))  # (B, T, in)
    gf = wide(g.reshape(B, -1, g.shape[-1]))  # (B, T, out)
    linear = isinstance(mod, nn.Linear)
    if "weight" in local:
        name = local["weight"]
        pos = single_positions(gf)
        if pos is not None:
            _weight_rank1(acc, name, linear, xf, gf, pos)
        elif acc.uses[name] == 1 and B * mod.weight.numel() <= _SMALL_BATCHED:
            # small weights: one batched matmul; few large ops beat a Python row loop
            gw = torch.bmm(gf.transpose(1, 2), xf) if linear else torch.bmm(xf.transpose(1, 2), gf)
            acc.add_squares(name, slice(0, B), gw)
        elif acc.uses[name] == 1:
            _weight_row_loop(acc, name, linear, mod.weight.shape, xf, gf)
        else:  # shared parameter: keep per-row gradients until every use arrived
            rb = acc.row_buffer(name)
            for i in range(B):
                rb[i].addmm_(gf[i].T, xf[i]) if linear else rb[i].addmm_(xf[i].T, gf[i])
        acc.use_done(name)
    if "bias" in local:
        acc.contribute(local["bias"], slice(0, B), gf.sum(1))  # (B, out)
        acc.use_done(local["bias"])


def _weight_row_loop(acc: Accumulator, name: str, linear: bool, shape: torch.Size,
                     xf: torch.Tensor, gf: torch.Tensor) -> None:
    """One row at a time into a reused buffer, squared straight into the sums: no (B, out, in)
    temporary, each per-row gradient read once."""
    buf = acc.buffer(shape, gf.dtype)
    for i in range(gf.shape[0]):
        if linear:
            torch.mm(gf[i].T, xf[i], out=buf)  # (out, in)
        else:
            torch.mm(xf[i].T, gf[i], out=buf)  # (in, out)
        acc.add_row_square(name, i, buf)


def _weight_rank1(acc: Accumulator, name: str, linear: bool, xf: torch.Tensor, gf: torch.Tensor,
                  pos: torch.Tensor) -> None:
    """Rows whose gradient is the outer product g_n x_n^T: sum_n G_n^2 = (g^2)^T (x^2)."""
    ar = torch.arange(gf.shape[0], device=gf.device)
    gs, xs = gf[ar, pos], xf[ar, pos]  # (B, out), (B, in)
    a, b = (gs, xs) if linear else (xs, gs)
    if acc.uses[name] > 1:  # shared: per-row outer products into the row buffer
        acc.row_buffer(name).baddbmm_(a.unsqueeze(2), b.unsqueeze(1))
        return
    st = acc.store
    if st.check is not None:
        st.add_check(name, a.T @ b)
    a2, b2 = a.square(), b.square()
    groups = acc.groups_cpu
    if len(set(groups)) == 1:
        st.mm_into(name, groups[0], a2.T, b2)
        return
    for k in sorted(set(groups)):
        sel = acc.groups == k
        st.mm_into(name, k, a2[sel].T, b2[sel])


# --------------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------------


def embedding_rows(acc: Accumulator, mod: nn.Embedding, name: str, ids: torch.Tensor,
                   g: torch.Tensor, scale: float) -> None:
    """Per-row gradients of an embedding lookup; `scale`: d out / d lookup (scaled embeddings)."""
    B, V = g.shape[0], mod.num_embeddings
    ids = ids.reshape(B, -1)  # (B, T)
    gf = wide(g.reshape(B, ids.shape[1], -1))  # (B, T, d)
    if scale != 1.0:
        gf = gf * scale
    d = gf.shape[-1]
    if mod.padding_idx is not None:  # that row's gradient is always zero
        gf = gf * (ids != mod.padding_idx).unsqueeze(-1)
    if acc.uses[name] == 1:
        # sparse: sum gradients per (row, token), square, scatter into (G, V, d)
        row = torch.arange(B, device=ids.device).unsqueeze(1).expand_as(ids)
        key = (row * V + ids).reshape(-1)  # (B*T,)
        uniq, inv = torch.unique(key, return_inverse=True)
        per = torch.zeros((uniq.numel(), d), dtype=gf.dtype, device=gf.device)
        per.index_add_(0, inv, gf.reshape(-1, d))
        st = acc.store
        if st.check is not None:
            c = torch.zeros((V, d), dtype=st.dtype, device=gf.device)
            st.add_check(name, c.index_add_(0, uniq % V, per.to(st.dtype)))
        target = acc.groups[uniq // V] * V + uniq % V  # (U,) index into (G*V)
        s = st.zero_unfilled(name, sorted(set(acc.groups_cpu)))
        s.view(-1, d).index_add_(0, target, per.square().to(st.dtype))
        return
    step = acc.rows_per_chunk(V * d)
    for s0 in range(0, B, step):
        rows = slice(s0, min(B, s0 + step))
        b = rows.stop - rows.start
        dense = torch.zeros((b * V, d), dtype=gf.dtype, device=gf.device)
        off = torch.arange(b, device=ids.device).unsqueeze(1) * V
        dense.index_add_(0, (ids[rows] + off).reshape(-1), gf[rows].reshape(-1, d))
        acc.contribute(name, rows, dense.view(b, V, d))


def embedding_lookup(mod: nn.Embedding, args: tuple, kwargs: dict,
                     out: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """(ids, scale) when out == F.embedding(ids, weight) * scale for the call's first argument
    (plain nn.Embedding, and Gemma/XGLM/BioGPT `*ScaledWordEmbedding`); None when the module's
    forward is anything else (OPT/BioGPT learned positions take an attention mask)."""
    ids = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
        return None
    if type(mod).forward is nn.Embedding.forward:
        return ids, 1.0
    if tuple(ids.shape) != tuple(out.shape[:-1]) or ids.numel() == 0:
        return None
    if int(ids.min()) < 0 or int(ids.max()) >= mod.num_embeddings:
        return None
    es = getattr(mod, "embed_scale", 1.0)
    scale = float(es.to(mod.weight.dtype)) if isinstance(es, torch.Tensor) else float(es)
    with torch.no_grad():
        raw = torch.nn.functional.embedding(ids, mod.weight, mod.padding_idx)
        want = raw * torch.tensor(scale, dtype=raw.dtype, device=raw.device)
        tol = 1e-2 if raw.dtype in (torch.bfloat16, torch.float16) else 1e-6
        if not torch.allclose(out.detach(), want, rtol=tol, atol=0.0):
            return None
    return ids, scale


# --------------------------------------------------------------------------------------------
# Elementwise-affine modules and the generic path
# --------------------------------------------------------------------------------------------


def _wide_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    a = tuple(wide(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for t in args)
    kw = {k: wide(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
          for k, v in kwargs.items()}
    return a, kw


def affine_rows(acc: Accumulator, mod: nn.Module, names: list[tuple[str, str]], args: tuple,
                kwargs: dict, g: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Per-row grads (B, d) for modules elementwise-affine in 1-D params over the last dim
    (RMSNorm, LayerNorm, q_norm/k_norm, Gemma's (1 + w) norm): output = base + q * slope_q,
    so grad_q = sum over positions of g * slope_q, with slope_q = f(q=1) - f(all 0).
    Returns None when the parameter shapes do not fit; the affine assumption is verified once
    per module against the generic path (see hooks)."""
    from torch.func import functional_call

    d = g.shape[-1]
    if not all(getattr(mod, k).dim() == 1 and getattr(mod, k).shape[0] == d for k, _ in names):
        return None
    gf = wide(g)
    B = g.shape[0]
    a, kw = _wide_args(args, kwargs)
    zeros = {k: torch.zeros(d, dtype=gf.dtype, device=g.device) for k, _ in names}
    acc.recomputing = True
    try:
        with torch.no_grad():
            base = functional_call(mod, zeros, a, kw)
            out = {}
            for k, name in names:
                p = dict(zeros)
                p[k] = torch.ones(d, dtype=gf.dtype, device=g.device)
                slope = functional_call(mod, p, a, kw) - base  # (B, ..., d)
                out[name] = (gf * slope).reshape(B, -1, d).sum(1)  # (B, d)
    finally:
        acc.recomputing = False
    return out


def _unsq(t: Any) -> Any:
    return t.unsqueeze(0) if isinstance(t, torch.Tensor) else t


def generic_rows(acc: Accumulator, mod: nn.Module, names: list[tuple[str, str]], args: tuple,
                 kwargs: dict, g: torch.Tensor, sink: Callable | None = None) -> None:
    """Exact per-row gradients of any module: vmap over rows of vjp(functional_call)."""
    from torch.func import functional_call, vjp, vmap

    sink = sink or acc.contribute
    B = g.shape[0]
    params = {k: wide(getattr(mod, k).detach()) for k, _ in names}
    keys = list(kwargs)
    a, kw = _wide_args(args, kwargs)
    flat = list(a) + [kw[k] for k in keys]
    in_dims = tuple(0 if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == B
                    else None for t in flat)
    n_args = len(args)

    def one_row(gr: torch.Tensor, *row_flat: Any) -> dict[str, torch.Tensor]:
        ra = tuple(row_flat[:n_args])
        rkw = dict(zip(keys, row_flat[n_args:], strict=True))

        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            # the row has no batch dim now: add it back for modules that expect one
            out = functional_call(mod, p, tuple(_unsq(t) for t in ra),
                                  {k: _unsq(v) for k, v in rkw.items()})
            return out.squeeze(0)

        _, pull = vjp(f, params)
        return pull(wide(gr))[0]

    numel = sum(p.numel() for p in params.values())
    step = acc.rows_per_chunk(numel * 4)  # vjp temporaries
    acc.recomputing = True
    try:
        for s in range(0, B, step):
            rows = slice(s, min(B, s + step))
            chunk = [t[rows] if d == 0 else t for t, d in zip(flat, in_dims, strict=True)]
            grads = vmap(one_row, in_dims=(0, *in_dims))(g[rows], *chunk)
            for k, name in names:
                sink(name, rows, grads[k])
    finally:
        acc.recomputing = False
