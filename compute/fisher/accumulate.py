"""Per-group sums of squared per-row gradients, fed by captured module calls.

`Store` keeps, across forward passes, name -> per-group sums of squares (one (n_groups, *shape)
tensor per parameter) and, while the engine verifies a model, the plain
sum of the per-row gradients (== autograd's batch gradient when the maths is right).
`Accumulator` is one forward pass: its rows' groups and the uses of each parameter. A parameter
used by several module calls (tied embeddings) keeps a (B, *shape) buffer of per-row gradients
until every use arrived, then squares it: squares of sums, not sums of squares.
`add_call` routes one captured call (module, x, g) to the maths in `persample`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compute.fisher import persample as ps
from compute.lm.device import wide

# module -> whether the elementwise-affine shortcut matched the generic path on its first call
AFFINE_OK: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


@dataclass
class Call:
    """One captured module call: its inputs (detached), output gradient g (B, ...), and the
    tracked parameters it owns as (attribute, store name). lookup: (ids, scale) when the module
    is an embedding lookup (see hooks.embedding_lookup)."""

    module: nn.Module
    names: list[tuple[str, str]]
    args: tuple
    kwargs: dict
    g: torch.Tensor
    lookup: tuple[torch.Tensor, float] | None = None


class Store:
    """name -> (n_groups, *shape) sums of squared per-row gradients, kept across passes."""

    def __init__(self, shapes: dict[str, torch.Size], n_groups: int, dtype: torch.dtype,
                 device: torch.device, check: bool = False, squares: bool = True):
        """check: also keep the plain sum of per-row gradients (the engine's self-check);
        squares=False keeps only that (the check pass needs no squares: 4 bytes per parameter
        less while it runs)."""
        self.shapes, self.n_groups, self.dtype, self.device = shapes, n_groups, dtype, device
        self.squares = squares
        # name -> (n_groups, *shape), allocated (zeros) when the parameter's first square arrives:
        # the groups live in one tensor from the start, so finish() hands it over without the
        # stack that held every group twice (a 16-byte/param moment on the largest tensor)
        self.sums: dict[str, torch.Tensor] = {}
        self.check: dict[str, torch.Tensor] | None = {} if check else None

    def _groups(self, name: str) -> torch.Tensor:
        cur = self.sums.get(name)
        if cur is None:
            cur = self.sums[name] = torch.zeros((self.n_groups, *self.shapes[name]), dtype=self.dtype,
                                                device=self.device)
        return cur

    def add(self, name: str, k: int, sq: torch.Tensor) -> None:
        """Add sq (*shape) to group k."""
        if not self.squares:
            return
        self._groups(name)[k].add_(sq)

    def index_add(self, name: str, k: int, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Add rows (U, d) at positions index (U,) of group k's (V, d) sums."""
        if not self.squares:
            return
        self._groups(name)[k].index_add_(0, index, rows.to(self.dtype))

    def add_check(self, name: str, grad_sum: torch.Tensor) -> None:
        if self.check is not None:
            c = self.check.get(name)
            self.check[name] = grad_sum.to(self.dtype, copy=True) if c is None else c + grad_sum

    def finish(self) -> dict[str, torch.Tensor]:
        """name -> (n_groups, *shape); groups (or parameters) no row reached are zero."""
        out = {}
        for name, shape in self.shapes.items():
            cur = self.sums.pop(name, None)
            out[name] = cur if cur is not None else torch.zeros((self.n_groups, *shape), dtype=self.dtype,
                                                                 device=self.device)
        return out


class Accumulator:
    """One forward pass: its rows' groups, the uses of each parameter, per-row buffers of shared
    parameters (per-row gradients summed over all uses before squaring)."""

    def __init__(self, store: Store, groups: torch.Tensor, budget_bytes: int):
        self.store = store
        self.groups = groups  # (B,) long on the device
        self.budget = budget_bytes
        self.uses: dict[str, int] = {}
        self.arrived: dict[str, int] = {}
        self.rows: dict[str, torch.Tensor] = {}
        present = sorted(set(groups.tolist()))
        # (group, row index or None = all rows) for every group present in the pass
        self.selections: list[tuple[int, torch.Tensor | None]] = (
            [(present[0], None)] if len(present) == 1
            else [(k, (groups == k).nonzero().squeeze(1)) for k in present])

    def used(self, names: list[tuple[str, str]]) -> None:
        """Forward time: a module call will send gradients for these parameters."""
        for _, name in names:
            self.uses[name] = self.uses.get(name, 0) + 1

    def shared(self, name: str) -> bool:
        return self.uses[name] > 1

    def rows_per_chunk(self, numel_per_row: int) -> int:
        return max(1, self.budget // max(1, 4 * 2 * numel_per_row))

    def row_buffer(self, name: str) -> torch.Tensor:
        """(B, *shape) per-row gradient sums of a shared parameter (zeros on first use)."""
        buf = self.rows.get(name)
        if buf is None:
            buf = self.rows[name] = torch.zeros((self.groups.shape[0], *self.store.shapes[name]),
                                                dtype=self.store.dtype, device=self.groups.device)
        return buf

    def add_row_grads(self, name: str, rows: slice, grads: torch.Tensor) -> None:
        """Per-row gradients (b, *shape) of one use of a parameter for rows `rows`."""
        if self.shared(name):
            self.row_buffer(name)[rows] += grads
            return
        self._add_squares(name, rows, grads, in_place=False)

    def _add_squares(self, name: str, rows: slice, grads: torch.Tensor, in_place: bool) -> None:
        if self.store.check is not None:
            self.store.add_check(name, grads.sum(0))
        if len(self.selections) == 1:
            self.store.add(name, self.selections[0][0], ps.square_sum(grads, in_place=in_place))
            return
        grp = self.groups[rows]
        for k in sorted(set(grp.tolist())):
            self.store.add(name, k, ps.square_sum(grads[grp == k]))

    def use_done(self, name: str) -> None:
        self.arrived[name] = self.arrived.get(name, 0) + 1
        if self.shared(name) and self.arrived[name] == self.uses[name]:
            self._flush(name)

    def _flush(self, name: str) -> None:
        buf = self.rows.pop(name, None)
        if buf is not None:
            self._add_squares(name, slice(0, buf.shape[0]), buf, in_place=True)

    def finish_pass(self) -> None:
        # uses whose gradient never arrived (outputs not connected to the loss) contribute zero
        for name in list(self.rows):
            self._flush(name)
        self.uses.clear()
        self.arrived.clear()


def _pick(t: torch.Tensor | None, sel: torch.Tensor | None) -> Any:
    return t if t is None or sel is None else t[sel]


# --------------------------------------------------------------------------------------------
# routing a captured call to the per-layer maths
# --------------------------------------------------------------------------------------------


def add_call(acc: Accumulator, call: Call) -> None:
    """Add the per-row gradients of one module call to the pass (every tracked parameter)."""
    mod = call.module
    if isinstance(mod, nn.Linear) or ps.is_conv1d(mod):
        _linear(acc, call)
    elif isinstance(mod, nn.Embedding) and call.lookup is not None and \
            [k for k, _ in call.names] == ["weight"]:
        _embedding(acc, call)
    else:
        grads = _affine(acc, call)
        if grads is not None:
            for k, name in call.names:
                acc.add_row_grads(name, slice(0, call.g.shape[0]), grads[k])
        else:
            _generic(acc, call, sink=acc.add_row_grads)
    for _, name in call.names:
        acc.use_done(name)


def _linear(acc: Accumulator, call: Call) -> None:
    x = call.args[0] if call.args else next(iter(call.kwargs.values()))
    B = call.g.shape[0]
    xf = wide(x.reshape(B, -1, x.shape[-1]))  # (B, T, in)
    gf = wide(call.g.reshape(B, -1, call.g.shape[-1]))  # (B, T, out)
    conv = ps.is_conv1d(call.module)
    for key, name in call.names:
        if key == "bias":
            acc.add_row_grads(name, slice(0, B), ps.bias_row_grads(g=gf))
            continue
        pos = ps.single_positions(gf)
        if acc.shared(name):  # per-row gradients until every use arrived
            # the first use writes the buffer (no zero-fill), later ones add into it
            rows = ps.linear_row_grads(x=xf, g=gf, conv1d=conv, pos=pos, out=acc.rows.get(name))
            acc.rows[name] = rows.to(acc.store.dtype)
            continue
        if acc.store.check is not None:
            acc.store.add_check(name, ps.linear_grad_sum(x=xf, g=gf, conv1d=conv))
        for k, sel in acc.selections:
            acc.store.add(name, k, ps.linear_square_sum(x=_pick(xf, sel), g=_pick(gf, sel),
                                                        conv1d=conv, pos=_pick(pos, sel)))


def _embedding(acc: Accumulator, call: Call) -> None:
    mod = call.module
    assert isinstance(mod, nn.Embedding) and call.lookup is not None
    (_, name), = call.names
    ids, scale = call.lookup
    V = mod.num_embeddings
    row, vocab, grad = ps.embedding_row_grads(ids=ids, g=wide(call.g), num_embeddings=V,
                                              scale=scale, padding_idx=mod.padding_idx)
    st = acc.store
    if acc.shared(name):
        acc.row_buffer(name).view(-1, grad.shape[-1]).index_add_(0, row * V + vocab, grad)
        return
    if st.check is not None:
        c = torch.zeros(st.shapes[name], dtype=st.dtype, device=grad.device)
        st.add_check(name, c.index_add_(0, vocab, grad.to(st.dtype)))
    sq = grad.square()  # (U, d)
    if len(acc.selections) == 1:
        st.index_add(name, acc.selections[0][0], vocab, sq)
        return
    grp = acc.groups[row]
    for k, _ in acc.selections:
        m = grp == k
        st.index_add(name, k, vocab[m], sq[m])


def _generic(acc: Accumulator, call: Call, sink: Any) -> None:
    """vmap(vjp) per-row gradients of any module, chunked by the memory budget."""
    params = [k for k, _ in call.names]
    numel = sum(getattr(call.module, k).numel() for k in params)
    local = dict(call.names)
    for rows, grads in ps.generic_row_grads(module=call.module, params=params, args=call.args,
                                            kwargs=call.kwargs, g=call.g,
                                            rows_per_chunk=acc.rows_per_chunk(numel * 4)):
        for k, gr in grads.items():
            sink(local[k], rows, gr)


def _affine(acc: Accumulator, call: Call) -> dict[str, torch.Tensor] | None:
    """The affine shortcut's per-row grads (attribute -> (B, d)), verified against the generic
    path on the module's first call; None (generic path) for a module that failed."""
    mod = call.module
    verdict = AFFINE_OK.get(mod)
    if verdict is False or isinstance(mod, nn.Embedding):
        return None
    params = [k for k, _ in call.names]
    fast = ps.affine_row_grads(module=mod, params=params, args=call.args, kwargs=call.kwargs,
                               g=call.g)
    if fast is None:
        AFFINE_OK[mod] = False
        return None
    if verdict is None:  # first call: verify against the generic path
        parts: dict[str, list[torch.Tensor]] = {}
        by_name = {n: k for k, n in call.names}
        _generic(acc, call, sink=lambda n, rows, gr: parts.setdefault(by_name[n], []).append(gr))
        ref = {k: torch.cat(v) for k, v in parts.items()}
        ok = all(torch.allclose(fast[k], ref[k], rtol=1e-4,
                                atol=1e-5 * float(ref[k].abs().max()) + 1e-30) for k in ref)
        AFFINE_OK[mod] = ok
        return fast if ok else ref
    return fast
