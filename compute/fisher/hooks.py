"""Forward hooks that capture each parameter-owning module's inputs x and output gradient g,
so that one backward (activation gradients only) yields every row's parameter gradient.

The hooks only capture: each module call becomes an `accumulate.Call` (x, g, the tracked
parameters it owns) handed to a sink (`accumulate.Accumulator`), which does the maths. They are
attached in `PerSampleHooks.__enter__` and removed in `__exit__`, also when the forward or the
backward raises. They refuse, with an `UnsupportedModel` error naming the module and the reason,
whatever they cannot capture exactly: outputs that are not one tensor, outputs whose rows are not
one per sequence (mixture-of-experts routing), embeddings with max_norm, and (checked by
`check_coverage` after the first pass) parameters that reach the loss outside their module's
forward (fused kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compute.fisher import persample as ps
from compute.fisher.accumulate import Accumulator, Call, add_call

_NORM_SUFFIXES = ("RMSNorm", "LayerNorm", "Norm")
_MOE_HINTS = ("Router", "Expert", "Moe", "MoE", "Gate", "Sparse")


class UnsupportedModel(NotImplementedError):
    """The exact engine cannot form this model's per-sample gradients (the message says why)."""


def _arch(model: nn.Module) -> str:
    archs = getattr(getattr(model, "config", None), "architectures", None)
    return archs[0] if archs else type(model).__name__


def position_wise(mod: nn.Module) -> bool:
    """Modules that act on each position alone, so a (B*T, ...) call is still per-row exact."""
    return (isinstance(mod, (nn.Linear, nn.LayerNorm, nn.Embedding)) or ps.is_conv1d(mod)
            or type(mod).__name__.endswith(_NORM_SUFFIXES))


class PerSampleHooks:
    """Context manager: hooks that capture every tracked module call's (x, g) into `acc`.

    names: id(parameter) -> store name of the parameters to track. All hooks are removed in
    `__exit__` (also when the forward or backward raises)."""

    def __init__(self, model: nn.Module, acc: Accumulator, names: dict[int, str], batch: int,
                 width: int, detach_lookups: bool = True):
        """detach_lookups=False (the engine's self-check): an embedding's output stays in the
        graph, so the same backward also gives autograd's own gradient of every parameter."""
        self.model, self.acc, self.names = model, acc, names
        self.detach_lookups = detach_lookups
        self.batch, self.width = batch, width
        self.handles: list[Any] = []
        self.leaves: list[torch.Tensor] = []
        self.seen: set[str] = set()  # parameters whose per-row gradients were formed
        self.paths: dict[nn.Module, str] = {}
        self.error: Exception | None = None
        self.quiet = False  # set while the maths re-runs a module (affine, generic paths)

    def __enter__(self) -> PerSampleHooks:
        try:
            for path, module in self.model.named_modules():
                self.paths[module] = path or type(module).__name__
                own = [(k, self.names[id(p)]) for k, p in module._parameters.items()
                       if p is not None and id(p) in self.names]
                if own or isinstance(module, nn.Embedding):
                    self.handles.append(module.register_forward_hook(
                        self._make_hook(own), with_kwargs=True))
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

    def refuse(self, mod: nn.Module, what: str) -> UnsupportedModel:
        cfg = getattr(self.model, "config", None)
        experts = max(int(getattr(cfg, k, 0) or 0) for k in ("num_experts", "num_local_experts"))
        moe = experts > 1 or any(h in type(mod).__name__ for h in _MOE_HINTS)
        why = (" (mixture-of-experts routing sends tokens of different sequences through "
               "shared expert weights, so per-sequence gradients cannot be separated)" if moe
               else "")
        return UnsupportedModel(
            f"model: {_arch(self.model)} is not supported by the exact per-sample engine: "
            f"module {self.paths.get(mod, '?')} ({type(mod).__name__}) {what}{why}")

    def _check_output(self, mod: nn.Module, names: list, output: Any) -> str:
        """"rows" when the output has one row per sequence, "flat" for a (B*T, ...)
        position-wise call, "skip" for an untracked module; raises when the module owns
        tracked parameters and its output cannot be made per-row."""
        if not isinstance(output, torch.Tensor):
            if names:
                raise self.refuse(mod, f"owns parameters {[n for _, n in names]} but returns a "
                                       f"{type(output).__name__}, not one tensor, so its output gradient "
                                       "cannot be taken")
            return "skip"
        n = output.shape[0] if output.dim() else 0
        if n == self.batch:
            return "rows"
        if n == self.batch * self.width and position_wise(mod):
            return "flat"
        if names:
            raise self.refuse(mod, f"returns {n} rows, not one per sequence ({self.batch}) "
                                   f"or per token ({self.batch}x{self.width})")
        return "skip"

    def _make_hook(self, names: list[tuple[str, str]]) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if self.quiet or not torch.is_grad_enabled():
                return None
            shape = self._check_output(mod, names, output)
            if shape == "skip":
                return None
            new_out = None
            if isinstance(mod, nn.Embedding) and self.detach_lookups:
                # A leaf: the backward starts here and never computes the embedding .grad.
                new_out = output.detach().requires_grad_(True)
                self.leaves.append(new_out)
                output = new_out
            if not names or not output.requires_grad:
                return new_out
            output.register_hook(self._capture(mod, names, args, kwargs, output, shape))
            return new_out

        return hook

    def _capture(self, mod: nn.Module, names: list[tuple[str, str]], args: tuple, kwargs: dict,
                 output: torch.Tensor, shape: str) -> Callable[[torch.Tensor], None]:
        """Save the call's inputs now; the returned tensor hook hands (x, g) to the sink."""
        lookup = None
        if isinstance(mod, nn.Embedding):
            if mod.max_norm is not None:
                raise self.refuse(mod, "uses max_norm (it renormalises weights in the forward)")
            lookup = embedding_lookup(mod, args, kwargs, output)
        self.acc.used(names, mod, lookup)
        saved_args = _detach(args)
        saved_kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v
                        for k, v in kwargs.items()}
        if shape == "flat":
            saved_args, saved_kwargs = self._rowify(saved_args), self._rowify(saved_kwargs)

        def on_grad(g: torch.Tensor) -> None:
            try:
                if shape == "flat":
                    g = g.reshape(self.batch, self.width, *g.shape[1:])  # (B, T, ...)
                self.seen.update(n for _, n in names)
                self.quiet = True
                try:
                    add_call(self.acc, Call(mod, names, saved_args, saved_kwargs, g, lookup))
                finally:
                    self.quiet = False
            except Exception as exc:  # re-raised after backward (autograd wraps errors)
                self.error = self.error or exc
                raise

        return on_grad

    def _rowify(self, obj: Any) -> Any:
        """(B*T, ...) tensors -> (B, T, ...) (a position-wise module called on flat tokens)."""
        BT = self.batch * self.width

        def one(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == BT:
                return t.reshape(self.batch, self.width, *t.shape[1:])
            return t

        if isinstance(obj, dict):
            return {k: one(v) for k, v in obj.items()}
        return tuple(one(t) for t in obj)


def _detach(args: tuple) -> tuple:
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


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


def graph_parameters(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors (parameters) the autograd graph of `loss` reaches."""
    out: set[int] = set()
    seen: set[int] = set()
    keep: list[Any] = []  # node wrappers stay alive, so their ids are never reused
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        keep.append(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            out.add(id(var))
        stack.extend(f for f, _ in fn.next_functions)
    return out


def check_coverage(hooks: PerSampleHooks, reached: set[int], params: dict[str, nn.Parameter]) -> None:
    """Refuse when a parameter reaches the loss but no hook formed its per-row gradients."""
    missing = [n for n, p in params.items() if id(p) in reached and n not in hooks.seen]
    if missing:
        shown = ", ".join(missing[:6]) + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else "")
        raise UnsupportedModel(
            f"model: {_arch(hooks.model)} is not supported by the exact per-sample engine: "
            f"parameters {shown} reach the loss outside the forward of the module that owns them "
            "(e.g. a fused kernel reading conv1d.weight directly), so their per-sample gradients "
            "cannot be formed; refusing rather than reporting F = 0 for them")
