"""Exact, fast diagonal Fisher of causal LMs from per-sample gradients (../shared/SCIENCE.md s.2).

How: one batched forward + one backward that computes only activation gradients (never the
parameter .grad). Forward hooks on every module that owns parameters save its inputs; a tensor
hook on its output receives d(loss)/d(output). Because rows never interact in a causal LM forward,
the output gradient of row n is the gradient of row n's own summed completion log-prob, so each
row's parameter gradient is rebuilt exactly from (input, output-grad) of that row:

  nn.Linear        G_n = g_n^T x_n          (out, in)   batched matmul per row, chunked
  Conv1D (GPT-2)   G_n = x_n^T g_n          (in, out)
  nn.Embedding     G_n[v] = sum_{t: id_t = v} g_{n,t}   scatter-add per row (sparse)
  anything else    vmap over rows of vjp(functional_call(module)) (RMSNorm, LayerNorm, q_norm)

Parameters used by several modules or several calls (tied embeddings) have their per-row
gradients summed over all uses before squaring. All per-row maths runs in float32 even for a
bf16 model. The cost is one forward, one activation backward and the per-row weight-gradient
matmuls (the same FLOPs as an ordinary weight gradient): close to a plain forward+backward.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from compute.sampling import Rollout, build_rollout, position_ids_from_mask, sample_completions

ESTIMATORS = ("sequence", "token", "empirical", "batch")
# per-row gradients of at most this many elements in total are formed in one batched op
_SMALL_BATCHED = 1 << 20
# module -> whether its per-row gradients may use the elementwise-affine shortcut (verified once)
_AFFINE_OK: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision tensors; float64 stays float64 (exact reference runs)."""
    return t if t.dtype == torch.float64 else t.float()


def _is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D without importing transformers here
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


# --------------------------------------------------------------------------------------------
# Per-sample squared gradients: hooks inside a context manager
# --------------------------------------------------------------------------------------------


class _Accumulator:
    """Per-group sums of squared per-row gradients, and the per-row buffers of shared params."""

    def __init__(self, names: dict[int, str], shapes: dict[str, torch.Size], groups: torch.Tensor,
                 n_groups: int, device: torch.device, budget_bytes: int,
                 dtype: torch.dtype = torch.float32):
        self.names = names  # id(param) -> name
        self.shapes = shapes
        self.groups = groups  # (B,) long on device, sorted
        self.groups_cpu = groups.tolist()
        self.n_groups = n_groups
        self.device = device
        self.budget = budget_bytes
        self.dtype = dtype
        self.sums: dict[str, torch.Tensor] = {}  # name -> (G, *shape) float32
        self.uses: dict[str, int] = {}  # uses seen in this forward
        self.arrived: dict[str, int] = {}
        self.rows: dict[str, torch.Tensor] = {}  # name -> (B, *shape) per-row grads (shared only)
        self.scratch: dict[tuple, torch.Tensor] = {}

    def rows_per_chunk(self, numel_per_row: int) -> int:
        return max(1, self.budget // max(1, 4 * 2 * numel_per_row))

    def _add_squares(self, name: str, rows: slice, grad: torch.Tensor) -> None:
        """grad (b, *shape) per-row gradients of rows `rows`: add their squares per group."""
        acc = self._sum(name)
        if grad[0].numel() * grad.shape[0] <= _SMALL_BATCHED:
            acc.index_add_(0, self.groups[rows], grad.square())
            return
        # one fused multiply-add per row into its group's sum: reads each per-row gradient once
        # (measured faster on CPU than square().sum(0) or a norm over the row dim)
        g_rows = self.groups_cpu[rows.start : rows.stop]
        for i, k in enumerate(g_rows):
            acc[k].addcmul_(grad[i], grad[i])

    def buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor reused across modules of the same shape (saves page faults)."""
        key = (tuple(shape), dtype)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def _sum(self, name: str) -> torch.Tensor:
        acc = self.sums.get(name)
        if acc is None:
            acc = self.sums[name] = torch.zeros(
                (self.n_groups, *self.shapes[name]), dtype=self.dtype, device=self.device
            )
        return acc

    def add_row_square(self, name: str, row: int, grad: torch.Tensor) -> None:
        """grad (*shape): the whole gradient of one row (single-use parameter)."""
        self._sum(name)[self.groups_cpu[row]].addcmul_(grad, grad)

    def row_buffer(self, name: str) -> torch.Tensor:
        """(B, *shape) per-row gradient sums of a shared parameter (zeros on first use)."""
        buf = self.rows.get(name)
        if buf is None:
            B = self.groups.shape[0]
            buf = self.rows[name] = torch.zeros(
                (B, *self.shapes[name]), dtype=self.dtype, device=self.device
            )
        return buf

    def contribute(self, name: str, rows: slice, grad: torch.Tensor) -> None:
        """Per-row gradient (b, *shape) of one use of a parameter for rows `rows`."""
        if self.uses[name] == 1:
            self._add_squares(name, rows, grad)
            return
        self.row_buffer(name)[rows] += grad

    def use_done(self, name: str) -> None:
        self.arrived[name] = self.arrived.get(name, 0) + 1
        if self.uses[name] > 1 and self.arrived[name] == self.uses[name]:
            self._flush(name)

    def _flush(self, name: str) -> None:
        buf = self.rows.pop(name, None)
        if buf is not None:
            self._add_squares(name, slice(0, buf.shape[0]), buf)

    def finish_pass(self) -> None:
        # uses whose gradient never arrived (outputs not connected to the loss) contribute zero
        for name in list(self.rows):
            self._flush(name)
        self.uses.clear()
        self.arrived.clear()


class _PerSampleHooks:
    """Context manager: hooks that turn one backward into per-row squared gradients.

    All hooks are removed in `__exit__` (also when the forward or backward raises)."""

    def __init__(self, model: nn.Module, acc: _Accumulator):
        self.model = model
        self.acc = acc
        self.handles: list[Any] = []
        self.leaves: list[torch.Tensor] = []
        self.batch = 0
        self.recomputing = False
        self.error: Exception | None = None

    def __enter__(self) -> _PerSampleHooks:
        try:
            for module in self.model.modules():
                own = [(k, p) for k, p in module._parameters.items()
                       if p is not None and id(p) in self.acc.names]
                if own or isinstance(module, nn.Embedding):
                    self.handles.append(module.register_forward_hook(
                        self._make_hook(module, own), with_kwargs=True))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.leaves.clear()

    def _make_hook(self, module: nn.Module, own: list[tuple[str, nn.Parameter]]) -> Callable:
        names = [(k, self.acc.names[id(p)]) for k, p in own]

        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if self.recomputing or not torch.is_grad_enabled():
                return None
            if not isinstance(output, torch.Tensor):
                if names:
                    raise NotImplementedError(
                        f"model: per-sample gradients need a tensor output from "
                        f"{type(mod).__name__} (it owns parameters {[n for _, n in names]})")
                return None
            if output.shape[0] != self.batch:
                raise NotImplementedError(
                    f"model: {type(mod).__name__} output has batch dim {output.shape[0]}, not "
                    f"{self.batch}; per-sample gradients need one output row per sequence "
                    "(pass position_ids of shape (B, L))")
            new_out = None
            if isinstance(mod, nn.Embedding):
                # A leaf: the backward starts here and never computes the embedding .grad.
                new_out = output.detach().requires_grad_(True)
                self.leaves.append(new_out)
                output = new_out
            if not names or not output.requires_grad:
                return new_out
            for _, name in names:
                self.acc.uses[name] = self.acc.uses.get(name, 0) + 1
            saved_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            saved_kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v
                            for k, v in kwargs.items()}

            def on_grad(g: torch.Tensor) -> None:
                try:
                    self._per_row(mod, names, saved_args, saved_kwargs, g)
                except Exception as exc:  # re-raised after backward (autograd wraps errors)
                    self.error = self.error or exc
                    raise

            output.register_hook(on_grad)
            return new_out

        return hook

    # --- per-row gradients of one module call -------------------------------------------------

    def _per_row(self, mod: nn.Module, names: list[tuple[str, str]], args: tuple, kwargs: dict,
                 g: torch.Tensor) -> None:
        acc = self.acc
        B = g.shape[0]
        x = args[0] if args else next(iter(kwargs.values()))
        local = dict(names)
        if isinstance(mod, nn.Linear) or _is_conv1d(mod):
            xf = _wide(x.reshape(B, -1, x.shape[-1]))  # (B, T, in)
            gf = _wide(g.reshape(B, -1, g.shape[-1]))  # (B, T, out)
            if "weight" in local:
                name = local["weight"]
                linear = isinstance(mod, nn.Linear)
                if acc.uses[name] == 1 and B * mod.weight.numel() <= _SMALL_BATCHED:
                    # small weights: one batched matmul; few large ops beat a Python row loop
                    if linear:
                        gw = torch.bmm(gf.transpose(1, 2), xf)  # (B, out, in)
                    else:
                        gw = torch.bmm(xf.transpose(1, 2), gf)  # (B, in, out)
                    acc._add_squares(name, slice(0, B), gw)
                elif acc.uses[name] == 1:
                    # one row at a time into a reused buffer, squared straight into the sums:
                    # no (B, out, in) temporary, each per-row gradient read once
                    buf = acc.buffer(mod.weight.shape, gf.dtype)
                    for i in range(B):
                        if linear:
                            torch.mm(gf[i].T, xf[i], out=buf)  # (out, in)
                        else:
                            torch.mm(xf[i].T, gf[i], out=buf)  # (in, out)
                        acc.add_row_square(name, i, buf)
                else:  # shared parameter: keep per-row gradients until every use arrived
                    rb = acc.row_buffer(name)
                    for i in range(B):
                        if linear:
                            rb[i].addmm_(gf[i].T, xf[i])
                        else:
                            rb[i].addmm_(xf[i].T, gf[i])
                acc.use_done(name)
            if "bias" in local:
                acc.contribute(local["bias"], slice(0, B), gf.sum(1))  # (B, out)
                acc.use_done(local["bias"])
            return
        if isinstance(mod, nn.Embedding) and set(local) == {"weight"}:
            if mod.max_norm is not None:
                raise NotImplementedError("model: nn.Embedding with max_norm is not supported")
            self._embedding(mod, local["weight"], x, g)
            acc.use_done(local["weight"])
            return
        verdict = _AFFINE_OK.get(mod)
        fast = self._affine(mod, names, args, kwargs, g) if verdict is not False else None
        if fast is not None and verdict is None:  # first call: verify against the generic path
            parts: dict[str, list[torch.Tensor]] = {}
            self._generic(mod, names, args, kwargs, g,
                          sink=lambda n, rows, gr: parts.setdefault(n, []).append(gr))
            ref = {n: torch.cat(v) for n, v in parts.items()}
            ok = all(torch.allclose(fast[n], ref[n], rtol=1e-4,
                                    atol=1e-5 * float(ref[n].abs().max()) + 1e-30) for n in ref)
            _AFFINE_OK[mod] = ok
            fast = fast if ok else ref
        elif fast is None:
            _AFFINE_OK[mod] = False
        if fast is not None:
            for _, name in names:
                acc.contribute(name, slice(0, B), fast[name])
                acc.use_done(name)
            return
        self._generic(mod, names, args, kwargs, g)
        for _, name in names:
            acc.use_done(name)

    def _embedding(self, mod: nn.Embedding, name: str, ids: torch.Tensor, g: torch.Tensor) -> None:
        acc = self.acc
        B, V = g.shape[0], mod.num_embeddings
        ids = ids.reshape(B, -1)  # (B, T)
        gf = _wide(g.reshape(B, ids.shape[1], -1))  # (B, T, d)
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
            target = acc.groups[uniq // V] * V + uniq % V  # (U,) index into (G*V)
            s = acc.sums.get(name)
            if s is None:
                s = acc.sums[name] = torch.zeros((acc.n_groups, V, d), dtype=acc.dtype,
                                                 device=acc.device)
            s.view(-1, d).index_add_(0, target, per.square())
            return
        step = acc.rows_per_chunk(V * d)
        for s0 in range(0, B, step):
            rows = slice(s0, min(B, s0 + step))
            b = rows.stop - rows.start
            dense = torch.zeros((b * V, d), dtype=gf.dtype, device=gf.device)
            off = torch.arange(b, device=ids.device).unsqueeze(1) * V
            dense.index_add_(0, (ids[rows] + off).reshape(-1), gf[rows].reshape(-1, d))
            acc.contribute(name, rows, dense.view(b, V, d))

    def _affine(self, mod: nn.Module, names: list[tuple[str, str]], args: tuple, kwargs: dict,
                g: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Per-row grads (B, d) for modules elementwise-affine in 1-D params over the last dim
        (RMSNorm, LayerNorm, q_norm/k_norm, Gemma's (1 + w) norm): output = base + q * slope_q,
        so grad_q = sum over positions of g * slope_q, with slope_q = f(q=1) - f(all 0).
        Returns None when the parameter shapes do not fit; correctness of the affine assumption
        is verified once per module against the generic path (see _per_row)."""
        from torch.func import functional_call

        d = g.shape[-1]
        if not all(getattr(mod, k).dim() == 1 and getattr(mod, k).shape[0] == d for k, _ in names):
            return None
        gf = _wide(g)
        B = g.shape[0]
        a = tuple(_wide(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                  for t in args)
        kw = {k: _wide(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in kwargs.items()}
        zeros = {k: torch.zeros(d, dtype=gf.dtype, device=g.device) for k, _ in names}
        self.recomputing = True
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
            self.recomputing = False
        return out

    def _generic(self, mod: nn.Module, names: list[tuple[str, str]], args: tuple, kwargs: dict,
                 g: torch.Tensor, sink: Callable | None = None) -> None:
        """Exact per-row gradients of any module: vmap over rows of vjp(functional_call)."""
        from torch.func import functional_call, vjp, vmap

        acc = self.acc
        sink = sink or acc.contribute
        B = g.shape[0]
        params = {k: _wide(getattr(mod, k).detach()) for k, _ in names}
        keys = list(kwargs)
        flat = list(args) + [kwargs[k] for k in keys]
        flat = [_wide(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in flat]
        in_dims = tuple(0 if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == B
                        else None for a in flat)
        n_args = len(args)

        def one_row(gr: torch.Tensor, *row_flat: Any) -> dict[str, torch.Tensor]:
            a = tuple(row_flat[:n_args])
            kw = dict(zip(keys, row_flat[n_args:], strict=True))

            def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
                # the row has no batch dim now: add it back for modules that expect one
                out = functional_call(mod, p, tuple(_unsq(t) for t in a),
                                      {k: _unsq(v) for k, v in kw.items()})
                return out.squeeze(0)

            _, pull = vjp(f, params)
            return pull(_wide(gr))[0]

        numel = sum(p.numel() for p in params.values())
        step = acc.rows_per_chunk(numel * 4)  # vjp temporaries
        self.recomputing = True
        try:
            for s in range(0, B, step):
                rows = slice(s, min(B, s + step))
                chunk = [a[rows] if d == 0 else a for a, d in zip(flat, in_dims, strict=True)]
                grads = vmap(one_row, in_dims=(0, *in_dims))(g[rows], *chunk)
                for k, name in names:
                    sink(name, rows, grads[k])
        finally:
            self.recomputing = False


def _unsq(t: Any) -> Any:
    return t.unsqueeze(0) if isinstance(t, torch.Tensor) else t


# --------------------------------------------------------------------------------------------
# Public engine
# --------------------------------------------------------------------------------------------


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter for every named parameter that requires grad (tied weights once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _row_loss(model: nn.Module, ids: torch.Tensor, am: torch.Tensor, cm: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    """sum_n scale_n * sum_t cm[n,t] log p(ids[n,t] | ids[n,<t])  (scalar, float32)."""
    logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am),
                   use_cache=False).logits  # (B, L, V)
    lp = _wide(logits[:, :-1]).log_softmax(-1)  # (B, L-1, V)
    tok = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L-1)
    w = cm[:, 1:].to(tok.dtype) * scale.to(tok.dtype).unsqueeze(1)  # (B, L-1)
    return (tok * w).sum()


def _auto_batch(model: nn.Module, L: int, budget_bytes: int, shared_numel: int) -> int:
    """Rows per forward so that activations + per-row buffers of shared params fit the budget."""
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 256)
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 4)
    vocab = getattr(cfg, "vocab_size", 32000)
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    per_row = 4 * L * (layers * (12 * hidden + 4 * inter) + 4 * vocab) + 4 * shared_numel
    return max(1, budget_bytes // max(1, per_row))


def _shared_numel(model: nn.Module, params: dict[str, nn.Parameter]) -> int:
    """Total size of parameters owned by more than one module (tied weights)."""
    count: dict[int, int] = {}
    for m in model.modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                count[id(p)] = count.get(id(p), 0) + 1
    return sum(p.numel() for p in params.values() if count.get(id(p), 0) > 1)


def per_sample_square_sums(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, row_weights: torch.Tensor | None = None,
    groups: torch.Tensor | None = None, n_groups: int = 1, memory_budget_mb: int = 2048,
    batch_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """sum over rows n in group k of w_n * (d/dθ sum_t cm[n,t] log p(y_{n,t}))^2, per group.

    input_ids, attention_mask, completion_mask: (N, L); row_weights (N,) >= 0 (default 1);
    groups (N,) long in [0, n_groups). Returns name -> (n_groups, *param.shape) float32 on the
    model's device, for every parameter that requires grad.
    """
    device = _model_device(model)
    params = trainable_parameters(model)
    names = {id(p): n for n, p in params.items()}
    shapes = {n: p.shape for n, p in params.items()}
    N, L = input_ids.shape
    budget = int(memory_budget_mb) * 2**20
    w = torch.ones(N) if row_weights is None else row_weights.detach().double().cpu()
    if (w < 0).any():
        raise ValueError("weights: must be >= 0")
    grp = torch.zeros(N, dtype=torch.long) if groups is None else groups.long().cpu()
    order = torch.argsort(grp, stable=True)  # contiguous groups (see _Accumulator._add_squares)
    if not torch.equal(order, torch.arange(N)):
        input_ids, attention_mask, completion_mask = (
            input_ids[order.to(input_ids.device)], attention_mask[order.to(attention_mask.device)],
            completion_mask[order.to(completion_mask.device)])
        w, grp = w[order], grp[order]
    bs = batch_size or _auto_batch(model, L, budget, _shared_numel(model, params))
    sums: dict[str, torch.Tensor] = {}
    f64 = any(p.dtype == torch.float64 for p in params.values())
    acc_dtype = torch.float64 if f64 else torch.float32
    was_training = model.training
    model.eval()  # no dropout: the Fisher of the deterministic model
    try:
        for s in range(0, N, bs):
            ids = input_ids[s : s + bs].to(device)
            am = attention_mask[s : s + bs].to(device)
            cm = completion_mask[s : s + bs].to(device).bool()
            width = int(am.sum(1).max())  # right padding: drop all-pad columns
            ids, am, cm = ids[:, :width], am[:, :width], cm[:, :width]
            scale = w[s : s + bs].sqrt().to(device)  # squared grads scale by w_n
            acc = _Accumulator(names, shapes, grp[s : s + bs].to(device), n_groups, device, budget,
                               acc_dtype)
            acc.sums = sums
            with _PerSampleHooks(model, acc) as hooks:
                hooks.batch = ids.shape[0]
                loss = _row_loss(model, ids, am, cm, scale)
                inputs = list(hooks.leaves) or [p for p in params.values()]
                if loss.requires_grad:
                    try:
                        torch.autograd.grad(loss, inputs, allow_unused=True)
                    except Exception:
                        if hooks.error is not None:
                            raise hooks.error from None
                        raise
                acc.finish_pass()
    finally:
        model.train(was_training)
    for n, shape in shapes.items():
        if n not in sums:
            sums[n] = torch.zeros((n_groups, *shape), dtype=acc_dtype, device=device)
    return sums


def expand_tokens(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per counted token: the row truncated after that token, completion_mask one-hot.

    Returns (ids, attention_mask, completion_mask, source_row), each with n_tokens rows. Causal
    attention means later tokens never change an earlier log-prob, so truncation is exact."""
    rows, cols = completion_mask.bool().nonzero(as_tuple=True)  # (n_tokens,)
    ids = input_ids[rows]
    am = attention_mask[rows].clone()
    ar = torch.arange(input_ids.shape[1], device=input_ids.device)
    am = am * (ar.unsqueeze(0) <= cols.unsqueeze(1)).to(am.dtype)
    cm = ar.unsqueeze(0) == cols.unsqueeze(1)
    ids = torch.where(am.bool(), ids, ids[:, :1])  # pad value is irrelevant (masked, never counted)
    return ids, am, cm, rows


def _token_sorted(ids, am, cm, src):
    """Sort expanded rows by length so chunks drop their trailing padding (fewer FLOPs)."""
    order = am.sum(1).argsort(stable=True)
    return ids[order], am[order], cm[order], src[order]


def fisher_sums(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, estimator: str = "sequence", weights: torch.Tensor | None = None,
    groups: torch.Tensor | None = None, n_groups: int = 1, memory_budget_mb: int = 2048,
    batch_size: int | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-group sums of squared per-sample gradients and per-group denominators (n_groups,).

    sequence: sample = row, denominator = sum of row weights; token: sample = counted token,
    denominator = sum over tokens of their row's weight."""
    N = input_ids.shape[0]
    w = torch.ones(N, dtype=torch.float64) if weights is None else weights.double().cpu()
    if w.shape != (N,):
        raise ValueError(f"weights: shape {tuple(w.shape)}; need ({N},), one per row")
    grp = torch.zeros(N, dtype=torch.long) if groups is None else groups.long().cpu()
    if estimator == "sequence":
        sums = per_sample_square_sums(model, input_ids, attention_mask, completion_mask, w, grp,
                                      n_groups, memory_budget_mb, batch_size)
        denom = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, grp, w)
        return sums, denom
    if estimator == "token":
        ids, am, cm, src = _token_sorted(*expand_tokens(
            input_ids.cpu(), attention_mask.cpu(), completion_mask.cpu()))
        sums = per_sample_square_sums(model, ids, am, cm, w[src], grp[src], n_groups,
                                      memory_budget_mb, batch_size)
        denom = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, grp[src], w[src])
        return sums, denom
    raise ValueError(f"estimator: got {estimator!r}; accepted: sequence, token")


def fisher_from_samples(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, estimator: str = "sequence", weights: torch.Tensor | None = None,
    memory_budget_mb: int = 2048, batch_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Exact diagonal Fisher of the given samples: name -> float32 CPU tensor of the param shape.

    input_ids, attention_mask, completion_mask: (N, L), right-padded; attention_mask marks real
    tokens, completion_mask the tokens whose log-probs count.
    estimator="sequence": sum_n w_n g_n^2 / sum_n w_n with g_n = d/dθ sum_t log p(y_{n,t}).
      Cost ≈ one forward + one backward over the batch (see benchmarks/README.md).
    estimator="token": mean over counted tokens (weighted by their row's weight) of
      (d/dθ log p(y_{n,t}))^2. Each token needs its own gradient, so it expands the N rows into
      n_tokens truncated rows: cost ≈ (n_tokens / N) x (mean truncated length / L) x sequence,
      about T_completion x the sequence cost for completions of T tokens.
    weights: (N,) >= 0 per-row weights (None = 1). memory_budget_mb bounds the per-row gradient
    temporaries and the automatic forward batch (batch_size=None).
    """
    sums, denom = fisher_sums(model, input_ids, attention_mask, completion_mask, estimator,
                              weights, None, 1, memory_budget_mb, batch_size)
    d = float(denom.sum())
    if d <= 0:
        raise ValueError("completion_mask: no counted tokens (or all weights are zero)")
    return {n: (s.sum(0) / d).float().cpu() for n, s in sums.items()}


def batch_fisher(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, batch_size: int = 8,
) -> dict[str, torch.Tensor]:
    """Child-Tuning style: sum over minibatches of (d/dθ mean_n NLL_n)^2, NLL_n = -sum_t log p.

    Cheap and biased (cross-sample terms survive); a baseline, not the model Fisher."""
    device = _model_device(model)
    params = trainable_parameters(model)
    out = {n: torch.zeros(p.shape, dtype=torch.float32, device=device) for n, p in params.items()}
    N = input_ids.shape[0]
    was_training = model.training
    model.eval()
    try:
        for s in range(0, N, batch_size):
            ids = input_ids[s : s + batch_size].to(device)
            am = attention_mask[s : s + batch_size].to(device)
            cm = completion_mask[s : s + batch_size].to(device).bool()
            scale = torch.full((ids.shape[0],), -1.0 / ids.shape[0], device=device)
            loss = _row_loss(model, ids, am, cm, scale)
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for (n, _), gr in zip(params.items(), grads, strict=True):
                if gr is not None:
                    out[n] += gr.float().square()
    finally:
        model.train(was_training)
    return {n: t.cpu() for n, t in out.items()}


def _output_layer(model: nn.Module) -> tuple[nn.Module, str, str | None]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        raise ValueError("model: has no output embedding (unembedding) layer")
    by_id = {id(p): n for n, p in model.named_parameters()}
    w_name = by_id[id(head.weight)]
    b = getattr(head, "bias", None)
    return head, w_name, (by_id[id(b)] if b is not None else None)


@torch.no_grad()
def exact_output_fisher(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    completion_mask: torch.Tensor, normalize: str = "sequence", batch_size: int = 8,
) -> dict[str, torch.Tensor]:
    """Closed-form Fisher of the unembedding W (V, d) on the given prefixes, no sampling.

    For each counted position t (token t in the completion, predicted from h_{t-1}):
    F_t[v, :] = p_t[v] (1 - p_t[v]) h_t^2, and p(1 - p) for a bias. normalize="sequence": sum
    over positions, mean over rows (the limit of the `sequence` estimator, whose cross-position
    terms vanish in expectation); "token": mean over positions (the `token` estimator's limit).
    With tied embeddings this is the Fisher of the output use of W only.
    Returns {W name: (V, d) float32, [bias name: (V,)]} on CPU.
    """
    if normalize not in ("sequence", "token"):
        raise ValueError(f"normalize: got {normalize!r}; accepted: sequence, token")
    head, w_name, b_name = _output_layer(model)
    device = _model_device(model)
    V, d = head.weight.shape if isinstance(head, nn.Linear) else (head.weight.shape[0], -1)
    fw = torch.zeros(head.weight.shape, dtype=torch.float64, device=device)
    fb = torch.zeros((V,), dtype=torch.float64, device=device) if b_name else None
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda m, a, o: captured.append(a[0].detach()))
    n_pos = 0
    try:
        for s in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[s : s + batch_size].to(device)
            am = attention_mask[s : s + batch_size].to(device)
            cm = completion_mask[s : s + batch_size].to(device).bool()
            captured.clear()
            logits = model(input_ids=ids, attention_mask=am,
                           position_ids=position_ids_from_mask(am), use_cache=False).logits
            h = captured[-1][:, :-1].double()  # (b, L-1, d)
            p = logits[:, :-1].double().softmax(-1)  # (b, L-1, V)
            sel = cm[:, 1:]  # positions predicting a counted token
            pv = p[sel]  # (P, V)
            hs = h[sel]  # (P, d)
            a = pv * (1 - pv)  # (P, V)
            fw += a.T @ hs.square()  # (V, d)
            if fb is not None:
                fb += a.sum(0)
            n_pos += int(sel.sum())
    finally:
        handle.remove()
    denom = input_ids.shape[0] if normalize == "sequence" else max(1, n_pos)
    out = {w_name: (fw / denom).float().cpu()}
    if fb is not None and b_name:
        out[b_name] = (fb / denom).float().cpu()
    return out


# --------------------------------------------------------------------------------------------
# Config, result, end-to-end estimate
# --------------------------------------------------------------------------------------------


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class FisherConfig:
    estimator: str = _f("sequence", "sequence | token | empirical (gold answers) | batch")
    prompts: int = _f(16, "number of task prompts (ignored when prompts are given as a list)")
    samples: int = _f(4, "sampled completions per prompt (sequence/token)")
    max_new_tokens: int = _f(16, "maximum completion length in tokens")
    temperature: float = _f(1.0, "sampling temperature; 1.0 = the model's own distribution")
    top_k: int | None = _f(None, "None = full distribution (the Fisher's expectation)")
    top_p: float | None = _f(None, "None = full distribution")
    seed: int = _f(0, "seed of prompts and samples")
    prompt_start: int = _f(0, "index of the first task prompt (sharding)")
    batch_size: int | None = _f(None, "rows per forward/backward (None = from memory budget); "
                                      "minibatch size of the batch estimator (None = 8)")
    sample_batch_size: int | None = _f(64, "rows per generation batch")
    memory_budget_mb: int = _f(2048, "bound on per-sample-gradient temporaries, in MiB")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = _f("auto", "auto | float32 | bfloat16 | float16")

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator: got {self.estimator!r}; accepted: {', '.join(ESTIMATORS)}")
        for name, lo in (("prompts", 1), ("samples", 1), ("max_new_tokens", 1),
                         ("memory_budget_mb", 16)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: got {v!r}; must be an integer >= {lo}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: got {self.temperature!r}; must be > 0 (1.0 = on-policy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k: got {self.top_k!r}; must be >= 1 or None")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: got {self.top_p!r}; accepted range: (0, 1] or None")
        if self.seed < 0 or self.prompt_start < 0:
            raise ValueError("seed: seed and prompt_start must be >= 0")
        for name in ("batch_size", "sample_batch_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}: got {v!r}; must be >= 1 or None")


@dataclass
class FisherResult:
    """fisher: name -> float32 (param shape). n_rows sequences, n_tokens counted tokens.

    halves: per-parameter sums over two independent halves of the samples (even / odd prompt
    index), (2, *shape) float32, with half_denoms: their denominators (for split-half stability).
    """

    fisher: dict[str, torch.Tensor]
    n_rows: int
    n_tokens: int
    estimator: str
    settings: dict[str, Any]
    halves: dict[str, torch.Tensor] | None = None
    half_denoms: tuple[float, float] | None = None
    rollout: Rollout | None = None

    @property
    def n_samples(self) -> int:
        return self.n_tokens if self.estimator == "token" else self.n_rows

    def half(self, k: int) -> dict[str, torch.Tensor]:
        """Fisher estimated from half k (0 or 1) of the samples alone."""
        if self.halves is None or self.half_denoms is None:
            raise ValueError("halves: this result has no half-split sums")
        d = max(self.half_denoms[k], 1e-30)
        return {n: h[k] / d for n, h in self.halves.items()}


def _prompts_and_answers(task_or_prompts: Any, config: FisherConfig) -> tuple[list[str], list[str] | None]:
    if isinstance(task_or_prompts, (list, tuple)):
        items = list(task_or_prompts)
        if items and all(isinstance(x, str) for x in items):
            return items, None
        return [x.prompt for x in items], [x.answer for x in items]  # Examples
    ex = task_or_prompts.examples(config.prompts, seed=config.seed, split="train",
                                  start=config.prompt_start)
    return [e.prompt for e in ex], [e.answer for e in ex]


def estimate_fisher(
    model: nn.Module, tokenizer: Any, task_or_prompts: Any, config: FisherConfig,
    progress: Callable[[float, str], None] | None = None,
) -> FisherResult:
    """Sample on-policy (sequence/token) or take gold answers (empirical/batch), then estimate.

    task_or_prompts: a compute.tasks.Task, a list of prompt strings, or a list of Examples.
    Rows are processed in chunks of prompts with progress(fraction, message) after each chunk.
    """
    prog = progress or (lambda f, m="": None)
    prompts, answers = _prompts_and_answers(task_or_prompts, config)
    if not prompts:
        raise ValueError("prompts: no prompts to estimate the Fisher on")
    if config.estimator in ("empirical", "batch") and answers is None:
        raise ValueError(f"estimator: {config.estimator!r} needs gold answers; pass a task or "
                         "Examples, not bare prompt strings")
    t0 = time.perf_counter()
    prog(0.0, "sampling" if config.estimator in ("sequence", "token") else "tokenizing")
    if config.estimator in ("sequence", "token"):
        roll = sample_completions(
            model, tokenizer, prompts, config.samples, config.max_new_tokens, config.temperature,
            config.top_k, config.top_p, config.seed, config.sample_batch_size,
            prompt_offset=config.prompt_start)
    else:
        roll = build_rollout(tokenizer, prompts, answers or [], device=_model_device(model))
    prog(0.3, f"sampled {len(roll)} sequences")
    t_sample = time.perf_counter() - t0
    est = "sequence" if config.estimator == "empirical" else config.estimator
    n_tokens = int(roll.completion_mask.sum())
    halves = half_denoms = None
    if est == "batch":
        fisher = batch_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                              config.batch_size or 8)
    else:
        groups = ((roll.prompt_index + config.prompt_start) % 2).cpu()
        total: dict[str, torch.Tensor] = {}
        denom = torch.zeros(2, dtype=torch.float64)
        # chunk by prompts so progress is reported and the expanded token rows stay bounded
        n_chunks = max(1, min(len(prompts), 10))
        bounds = [round(i * len(prompts) / n_chunks) for i in range(n_chunks + 1)]
        for c in range(n_chunks):
            rows = ((roll.prompt_index >= bounds[c]) & (roll.prompt_index < bounds[c + 1])).cpu()
            idx = rows.nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            sub = roll.select(idx)
            sums, d = fisher_sums(model, sub.input_ids, sub.attention_mask, sub.completion_mask,
                                  est, None, groups[idx], 2, config.memory_budget_mb,
                                  config.batch_size)
            for n, s in sums.items():
                total[n] = total[n] + s if n in total else s
            denom += d
            prog(0.3 + 0.7 * (c + 1) / n_chunks, f"fisher {c + 1}/{n_chunks}")
        dsum = float(denom.sum())
        if dsum <= 0:
            raise ValueError("completion_mask: no counted tokens")
        fisher = {n: (s.sum(0) / dsum).float().cpu() for n, s in total.items()}
        halves = {n: s.float().cpu() for n, s in total.items()}
        half_denoms = (float(denom[0]), float(denom[1]))
    settings = {k: v for k, v in asdict(config).items()}
    settings.update(n_prompts=len(prompts), estimator_used=est,
                    sample_seconds=round(t_sample, 3),
                    total_seconds=round(time.perf_counter() - t0, 3))
    prog(1.0, "done")
    return FisherResult(fisher, len(roll), n_tokens, config.estimator, settings, halves,
                        half_denoms, roll)


def relative_error(est: torch.Tensor, ref: torch.Tensor) -> float:
    """||est - ref||_1 / ||ref||_1 (0 when both vanish)."""
    num = float((est.double() - ref.double()).abs().sum())
    den = float(ref.double().abs().sum())
    return 0.0 if den == 0 and num == 0 else (num / den if den > 0 else math.inf)


__all__ = [
    "ESTIMATORS", "FisherConfig", "FisherResult", "batch_fisher", "estimate_fisher",
    "exact_output_fisher", "expand_tokens", "fisher_from_samples", "fisher_sums",
    "per_sample_square_sums", "relative_error", "trainable_parameters",
]

