"""Forward hooks that save each parameter-owning module's inputs and catch its output gradient,
so that one backward (activation gradients only) yields every row's parameter gradient.

The hooks refuse, with an `UnsupportedModel` error naming the module and the reason, whatever
they cannot make exact: outputs that are not one tensor, outputs whose rows are not one per
sequence (mixture-of-experts routing), and (checked by `check_coverage` after the first pass)
parameters that reach the loss outside their module's forward (fused kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compute.fisher import persample as ps

_NORM_SUFFIXES = ("RMSNorm", "LayerNorm", "Norm")
_MOE_HINTS = ("Router", "Expert", "Moe", "MoE", "Gate", "Sparse")


class UnsupportedModel(NotImplementedError):
    """The exact engine cannot form this model's per-sample gradients (the message says why)."""


def _arch(model: nn.Module) -> str:
    archs = getattr(getattr(model, "config", None), "architectures", None)
    return archs[0] if archs else type(model).__name__


def _position_wise(mod: nn.Module) -> bool:
    """Modules that act on each position alone, so a (B*T, ...) call is still per-row exact."""
    return (isinstance(mod, (nn.Linear, nn.LayerNorm, nn.Embedding)) or ps.is_conv1d(mod)
            or type(mod).__name__.endswith(_NORM_SUFFIXES))


class PerSampleHooks:
    """Context manager: hooks that turn one backward into per-row squared gradients.

    All hooks are removed in `__exit__` (also when the forward or backward raises)."""

    def __init__(self, model: nn.Module, acc: ps.Accumulator, batch: int, width: int):
        self.model = model
        self.acc = acc
        self.batch, self.width = batch, width
        self.handles: list[Any] = []
        self.leaves: list[torch.Tensor] = []
        self.seen: set[str] = set()  # parameters whose per-row gradients were formed
        self.paths: dict[nn.Module, str] = {}
        self.error: Exception | None = None

    def __enter__(self) -> PerSampleHooks:
        try:
            for path, module in self.model.named_modules():
                self.paths[module] = path or type(module).__name__
                own = [(k, p) for k, p in module._parameters.items()
                       if p is not None and id(p) in self.acc.store_names]
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

    def _check_output(self, mod: nn.Module, names: list, output: Any) -> str | None:
        """None when the output is usable, "flat" for a (B*T, ...) position-wise call; raises
        when the module owns tracked parameters and its output cannot be made per-row."""
        if not isinstance(output, torch.Tensor):
            if names:
                raise self.refuse(mod, f"owns parameters {[n for _, n in names]} but returns a "
                                       f"{type(output).__name__}, not one tensor, so its output gradient "
                                       "cannot be taken")
            return "skip"
        n = output.shape[0] if output.dim() else 0
        if n == self.batch:
            return None
        if n == self.batch * self.width and _position_wise(mod):
            return "flat"
        if names:
            raise self.refuse(mod, f"returns {n} rows, not one per sequence ({self.batch}) "
                                   f"or per token ({self.batch}x{self.width})")
        return "skip"

    def _make_hook(self, module: nn.Module, own: list[tuple[str, nn.Parameter]]) -> Callable:
        names = [(k, self.acc.store_names[id(p)]) for k, p in own]

        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if self.acc.recomputing or not torch.is_grad_enabled():
                return None
            shape = self._check_output(mod, names, output)
            if shape == "skip":
                return None
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
            lookup = (ps.embedding_lookup(mod, args, kwargs, output)
                      if isinstance(mod, nn.Embedding) else None)
            saved_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            saved_kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v
                            for k, v in kwargs.items()}
            if shape == "flat":
                saved_args, saved_kwargs = self._rowify(saved_args), self._rowify(saved_kwargs)

            def on_grad(g: torch.Tensor) -> None:
                try:
                    if shape == "flat":
                        g = g.reshape(self.batch, self.width, *g.shape[1:])
                    self.seen.update(n for _, n in names)
                    self._per_row(mod, names, saved_args, saved_kwargs, g, lookup)
                except Exception as exc:  # re-raised after backward (autograd wraps errors)
                    self.error = self.error or exc
                    raise

            output.register_hook(on_grad)
            return new_out

        return hook

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

    # --- per-row gradients of one module call -------------------------------------------------

    def _per_row(self, mod: nn.Module, names: list[tuple[str, str]], args: tuple, kwargs: dict,
                 g: torch.Tensor, lookup: tuple[torch.Tensor, float] | None) -> None:
        acc = self.acc
        local = dict(names)
        if isinstance(mod, nn.Linear) or ps.is_conv1d(mod):
            x = args[0] if args else next(iter(kwargs.values()))
            ps.linear_rows(acc, mod, local, x, g)
            return
        if isinstance(mod, nn.Embedding) and set(local) == {"weight"} and lookup is not None:
            if mod.max_norm is not None:
                raise self.refuse(mod, "uses max_norm (it renormalises weights in the forward)")
            ps.embedding_rows(acc, mod, local["weight"], lookup[0], g, lookup[1])
            acc.use_done(local["weight"])
            return
        fast = self._affine(mod, names, args, kwargs, g)
        if fast is not None:
            for _, name in names:
                acc.contribute(name, slice(0, g.shape[0]), fast[name])
                acc.use_done(name)
            return
        ps.generic_rows(acc, mod, names, args, kwargs, g)
        for _, name in names:
            acc.use_done(name)

    def _affine(self, mod: nn.Module, names: list[tuple[str, str]], args: tuple, kwargs: dict,
                g: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The affine shortcut's per-row grads, verified against the generic path on the
        module's first call (and never used again for a module that failed)."""
        verdict = ps._AFFINE_OK.get(mod)
        if verdict is False or isinstance(mod, nn.Embedding):
            return None
        fast = ps.affine_rows(self.acc, mod, names, args, kwargs, g)
        if fast is None:
            ps._AFFINE_OK[mod] = False
            return None
        if verdict is None:  # first call: verify against the generic path
            parts: dict[str, list[torch.Tensor]] = {}
            ps.generic_rows(self.acc, mod, names, args, kwargs, g,
                            sink=lambda n, rows, gr: parts.setdefault(n, []).append(gr))
            ref = {n: torch.cat(v) for n, v in parts.items()}
            ok = all(torch.allclose(fast[n], ref[n], rtol=1e-4,
                                    atol=1e-5 * float(ref[n].abs().max()) + 1e-30) for n in ref)
            ps._AFFINE_OK[mod] = ok
            return fast if ok else ref
        return fast


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
