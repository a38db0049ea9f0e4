"""Per-group sums of squared per-row gradients, fed by captured module calls.

`Store` keeps, across forward passes, name -> per-group sums of squares (one (n_groups, *shape)
tensor per parameter; the two split halves of a float32 Fisher as `HalfSums`: an exact total and
an int16 fraction of it for the difference, 6 bytes per parameter) and, while the engine verifies
a model, the plain sum of the per-row gradients (== autograd's batch gradient when the maths is
right), for a group of the parameters at a time.
`Accumulator` is one forward pass: its rows' groups and the uses of each parameter. A parameter
used by several module calls keeps a (B, *shape) buffer of per-row gradients until every use
arrived, then squares it: squares of sums, not sums of squares. A tied embedding and output head
(the usual case) needs no such buffer (issue 30: it was vocab x hidden a row): a row's gradient
is the head's H_n plus the lookup's E_n, and E_n is zero outside the vocabulary rows the batch's
tokens touch, so every other row's square is the head's alone (summed like an untied head's) and
the touched rows' squares (H_n + E_n)^2 are computed exactly from the head's gradient at those
rows only (`_tied_head_use`, `_tied_squares`).
`add_call` routes one captured call (module, x, g) to the maths in `persample`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
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


# The half difference of a compact split (HalfSums) as a signed 16-bit fraction of the total:
# q = round(FRAC_SCALE * (A - B) / (A + B)), |A - B| <= A + B because every square is >= 0.
FRAC_SCALE = 32767.0
# values per slice of a dense update (temporaries of a few MB, whatever the tensor's size)
UPDATE_CHUNK = 1 << 20
# values per block of a large linear weight's squares (a block of its rows: 64 MB in float32), and
# at most this share of the temporaries budget for one block's parts (one per half present): the
# engine lets rows fill ROW_BUDGET_SHARE (3/4) of the budget, and the squares of a block come out
# of the rest. Measured (benchmarks/bench_scale.py --estimators token, 50M Llama with a 49,152-row
# tied head): whole 64 MB blocks put the token Fisher 0.9 bytes/param above 6 + its 256 MiB
# budget, 1.9 above a 128 MiB one.
BLOCK_VALUES = 1 << 24
BLOCK_BUDGET_SHARE = 1 / 8


class HalfSums:
    """Per-parameter sums over two halves A, B of the samples, held as their exact total
    T = A + B and their difference D = A - B (issue 30: 6 bytes/param instead of 8 for A and B).

    `diff[name]` is either the difference itself (a float tensor: exact up to the accumulator's
    rounding, as for float64 accumulation) or, compact, an int16 fraction q of the total,
    D = q / FRAC_SCALE * T. Each time a compact difference is re-encoded (`roundings`: at most
    that many times per coordinate) D moves by at most T / (2 FRAC_SCALE) of the final total, so
    a half (T +- D) / 2 is within `half_error_bound()` x T of its exact value. The total, and so
    the Fisher, is exact (float32 sums, as before)."""

    def __init__(self, total: dict[str, torch.Tensor], diff: dict[str, torch.Tensor], roundings: int = 0):
        self.total, self.diff, self.roundings = total, diff, roundings

    @property
    def compact(self) -> bool:
        return any(d.dtype == torch.int16 for d in self.diff.values())

    def half_error_bound(self) -> float:
        """Largest |computed half - exact half| over T, from the compact difference's roundings
        (0 when the difference is held exactly)."""
        return self.roundings / (4 * FRAC_SCALE) if self.compact else 0.0

    def difference(self, name: str) -> torch.Tensor:
        """A - B of one parameter, float (a tensor-sized temporary; zeros where no difference is
        held: the batch estimator's sums have none)."""
        d = self.diff.get(name)
        if d is None:
            return torch.zeros_like(self.total[name])
        if d.dtype != torch.int16:
            return d
        return d.float().mul_(self.total[name]).div_(FRAC_SCALE)

    def half(self, name: str, k: int) -> torch.Tensor:
        """A (k=0) or B (k=1) of one parameter, un-normalised (a new tensor)."""
        t, d = self.total[name], self.difference(name)
        return (t + d).div_(2) if k == 0 else (t - d).div_(2)

    def to_cpu_float32(self) -> HalfSums:
        """These sums on the CPU with float32 totals (a float difference in float32 too; an int16
        fraction as it is): what a Fisher estimate hands over. Itself when already so."""
        if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in self.total.values()) and \
                all(d.device.type == "cpu" and d.dtype in (torch.float32, torch.int16) for d in self.diff.values()):
            return self
        return HalfSums({n: t.float().cpu() for n, t in self.total.items()},
                        {n: (d if d.dtype == torch.int16 else d.float()).cpu() for n, d in self.diff.items()},
                        self.roundings)

    def view(self, k: int) -> HalfView:
        return HalfView(self, k)

    def stacked(self) -> dict[str, torch.Tensor]:
        """name -> (2, *shape) [A, B] (materialised: 8 bytes/param, for small models and tests)."""
        return {n: torch.stack([self.half(n, 0), self.half(n, 1)]) for n in self.total}

    @staticmethod
    def encode(total: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
        """The int16 fraction of `diff` in `total` (0 where the total is 0)."""
        q = torch.empty(total.shape, dtype=torch.int16, device=total.device)
        t, d, o_ = total.reshape(-1), diff.reshape(-1), q.view(-1)
        for o in range(0, t.numel(), UPDATE_CHUNK):
            r = d[o:o + UPDATE_CHUNK].float().div(t[o:o + UPDATE_CHUNK]).mul_(FRAC_SCALE).round_()
            o_[o:o + UPDATE_CHUNK] = r.nan_to_num_(0.0).clamp_(-FRAC_SCALE, FRAC_SCALE)
        return q

    @classmethod
    def merged(cls, parts: list[HalfSums]) -> HalfSums:
        """The sums of several HalfSums over the same parameters (shards of one job): totals
        add, differences add (compact ones decoded, summed, re-encoded once: one more rounding)."""
        parts = [p for p in parts if p.total]
        if len(parts) == 1:
            return parts[0]
        names = list(dict.fromkeys(n for p in parts for n in p.total))
        total, diff = {}, {}
        compact = any(p.compact for p in parts)
        differences = any(p.diff for p in parts)  # the batch estimator's sums hold none
        for n in names:
            have = [p for p in parts if n in p.total]
            t = have[0].total[n].clone()
            for p in have[1:]:
                t += p.total[n]
            total[n] = t
            if differences:
                d = have[0].difference(n).clone()
                for p in have[1:]:
                    d += p.difference(n)
                diff[n] = cls.encode(t, d) if compact else d
        rounds = sum(p.roundings for p in parts) + (1 if compact else 0)
        return cls(total, diff, rounds)


class HalfView(Mapping):
    """name -> half k's un-normalised sums, computed one tensor at a time on access (for the
    split-half statistics, which read a tensor at a time: no copy of all the values)."""

    def __init__(self, sums: HalfSums, k: int):
        self.sums, self.k = sums, k

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sums.half(name, self.k)

    def __iter__(self) -> Iterator[str]:
        return iter(self.sums.total)

    def __len__(self) -> int:
        return len(self.sums.total)

    def numel(self) -> int:
        return sum(t.numel() for t in self.sums.total.values())

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        """Half k's values in slices of at most `size`, tensor by tensor (temporaries of a
        slice: compute.fisher.statistics reads a HalfView this way). A compact half comes scaled
        by 2 FRAC_SCALE, T (FRAC_SCALE +- q): the same order, two operations per value fewer
        (the split-half statistics depend on the order only)."""
        for name, t in self.sums.total.items():
            tf, held = t.reshape(-1), self.sums.diff.get(name)
            for o in range(0, tf.numel(), size):
                yield self._of(tf[o:o + size], None if held is None else held.reshape(-1)[o:o + size])

    def numel_of(self, name: str) -> int:
        return int(self.sums.total[name].numel())

    def take(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        """Half k's values of one parameter at flat positions `idx`, as `chunks` gives them (the
        same operations on the same values: the same bits), for a sample of the values."""
        held = self.sums.diff.get(name)
        t = self.sums.total[name].reshape(-1)
        idx = idx.to(t.device)
        return self._of(t[idx], None if held is None else held.reshape(-1)[idx])

    def _of(self, tc: torch.Tensor, dc: torch.Tensor | None) -> torch.Tensor:
        sign = 1.0 if self.k == 0 else -1.0
        if dc is None:  # no difference held: each half is half the total
            return tc / 2
        if dc.dtype == torch.int16:  # S +- q is an integer below 2^16: made in float32 exactly, in one op
            return (torch.add(dc, FRAC_SCALE) if self.k == 0 else torch.rsub(dc, FRAC_SCALE)).mul_(tc)
        return (tc + sign * dc).div_(2)


class Store:
    """name -> sums of squared per-row gradients per group, kept across passes.

    n_groups groups are kept as one (n_groups, *shape) tensor per parameter, except two groups
    accumulated in float32 (`compact`, the split halves of every Fisher job): then the exact
    float32 total and an int16 fraction for the half difference (HalfSums: 6 bytes/param, not 8)."""

    def __init__(self, shapes: dict[str, torch.Size], n_groups: int, dtype: torch.dtype,
                 device: torch.device, check: bool = False, squares: bool = True,
                 check_names: set[str] | None = None):
        """check: also keep the plain sum of per-row gradients (the engine's self-check), for
        the parameters in check_names (None: all); squares=False keeps only that (the check pass
        needs no squares: 4 bytes per parameter less while it runs)."""
        self.shapes, self.n_groups, self.dtype, self.device = shapes, n_groups, dtype, device
        self.squares = squares
        self.compact = n_groups == 2 and dtype == torch.float32
        # name -> (n_groups, *shape), allocated (zeros) when the parameter's first square arrives:
        # the groups live in one tensor from the start, so finish() hands it over without the
        # stack that held every group twice (a 16-byte/param moment on the largest tensor).
        # Compact: name -> the total (*shape) float32, and self.frac name -> int16 (*shape).
        self.sums: dict[str, torch.Tensor] = {}
        self.frac: dict[str, torch.Tensor] = {}
        self.rounds: dict[str, int] = {}
        self.check: dict[str, torch.Tensor] | None = {} if check else None
        self.check_names = check_names
        self.check_seconds = 0.0  # time in the engine's self-check (estimators._verify)

    def _groups(self, name: str) -> torch.Tensor:
        cur = self.sums.get(name)
        if cur is None:
            cur = self.sums[name] = torch.zeros((self.n_groups, *self.shapes[name]), dtype=self.dtype,
                                                device=self.device)
        return cur

    def _compact(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.sums.get(name)
        if t is None:
            t = self.sums[name] = torch.zeros(self.shapes[name], dtype=self.dtype, device=self.device)
            self.frac[name] = torch.zeros(self.shapes[name], dtype=torch.int16, device=self.device)
        return t, self.frac[name]

    def add(self, name: str, k: int, sq: torch.Tensor) -> None:
        """Add sq (*shape) to group k."""
        self.add_groups(name, [(k, sq)])

    def add_groups(self, name: str, parts: list[tuple[int, torch.Tensor]], owned: bool = False) -> None:
        """Add each sq (*shape) of parts [(group k, sq)] to its group (one pass's squares: a
        compact difference is re-encoded once for all of them). owned: the parts are fresh
        tensors nothing else holds (the store may keep one as its sum instead of copying it)."""
        if not self.squares or not parts:
            return
        first = name not in self.sums  # written, not added: no zero-fill, no read of zeros
        if not self.compact:
            if first and owned and self.n_groups == 1 and len(parts) == 1:
                sq = parts[0][1]
                if sq.dtype == self.dtype and sq.shape == self.shapes[name] and sq.is_contiguous():
                    self.sums[name] = sq.unsqueeze(0)  # the caller's fresh tensor becomes the sum
                    return
            if first:
                self.sums[name] = g = torch.empty((self.n_groups, *self.shapes[name]), dtype=self.dtype,
                                                  device=self.device)
                written = set()
                for k, sq in parts:
                    g[k].add_(sq) if k in written else g[k].copy_(sq)
                    written.add(k)
                for k in set(range(self.n_groups)) - written:
                    g[k].zero_()
                return
            g = self._groups(name)
            for k, sq in parts:
                g[k].add_(sq)
            return
        if first:
            sq0 = parts[0][1]
            # an owned first part becomes the total (written over in _update, slice by slice)
            adopt = owned and sq0.dtype == self.dtype and sq0.shape == self.shapes[name] and sq0.is_contiguous()
            self.sums[name] = sq0 if adopt else torch.empty(self.shapes[name], dtype=self.dtype,
                                                            device=self.device)
            self.frac[name] = torch.empty(self.shapes[name], dtype=torch.int16, device=self.device)
        t, q = self.sums[name], self.frac[name]
        _update(t.view(-1), q.view(-1), [(k, sq.reshape(-1)) for k, sq in parts], first=first)
        self.rounds[name] = self.rounds.get(name, 0) + 1

    def add_row_squares(self, name: str, grads: torch.Tensor,
                        selections: list[tuple[int, torch.Tensor | None]]) -> None:
        """Add the squares of per-row gradients grads (B, *shape), summed over the rows of each
        selection [(group k, row indices or None = all rows)]. A compact store squares them slice
        by slice straight into its sums (no tensor-sized square sum, no copy of a group's rows)."""
        if not self.squares:
            return
        if not self.compact:
            from compute.fisher import persample as ps_

            self.add_groups(name, [(k, ps_.square_sum(grads if sel is None else grads[sel]))
                                   for k, sel in selections])
            return
        t, q = self._compact(name)
        flat = grads.reshape(grads.shape[0], -1)
        for k, sel in selections:  # one group at a time: only its rows are read, a slice at a time
            rows: Any = flat if sel is None else _RowsOf(flat, sel)
            _update(t.view(-1), q.view(-1), [(k, rows)], rows=True)
            self.rounds[name] = self.rounds.get(name, 0) + 1

    def add_block(self, name: str, block: slice, parts: list[tuple[int, torch.Tensor]]) -> None:
        """add_groups for the rows `block` of the parameter's first dimension only (parts hold
        (group k, sq of those rows)): a large weight's squares a block of rows at a time."""
        if not self.squares or not parts:
            return
        if not self.compact:
            g = self._groups(name)
            for k, sq in parts:
                g[k][block].add_(sq)
            return
        t, q = self._compact(name)
        _update(t[block].reshape(-1), q[block].view(-1), [(k, sq.reshape(-1)) for k, sq in parts])

    def block_done(self, name: str) -> None:
        """One pass's blocks of a parameter are all added (one rounding of each coordinate)."""
        if self.compact and self.squares:
            self.rounds[name] = self.rounds.get(name, 0) + 1

    def index_add(self, name: str, k: int, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Add rows (U, d) at positions index (U,) of group k's (V, d) sums."""
        self.index_add_groups(name, [(k, index, rows)])

    def index_add_groups(self, name: str, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """index_add for several groups at once: parts [(k, index (U,), rows (U, d))]."""
        if not self.squares or not parts:
            return
        if not self.compact:
            g = self._groups(name)
            for k, index, rows in parts:
                g[k].index_add_(0, index, rows.to(self.dtype))
            return
        t, q = self._compact(name)
        uniq, inv = torch.unique(torch.cat([ix for _, ix, _ in parts]), return_inverse=True)
        d = t.shape[-1]
        agg = {k: torch.zeros((uniq.numel(), d), dtype=self.dtype, device=t.device) for k, _, _ in parts}
        o = 0
        for k, ix, rows in parts:
            agg[k].index_add_(0, inv[o:o + ix.numel()], rows.to(self.dtype))
            o += ix.numel()
        tr, qr = t[uniq], q[uniq]  # the touched rows only
        _update(tr.view(-1), qr.view(-1), [(k, a.view(-1)) for k, a in agg.items()])
        t[uniq], q[uniq] = tr, qr
        self.rounds[name] = self.rounds.get(name, 0) + 1

    def add_check(self, name: str, grad_sum: torch.Tensor) -> None:
        """Add a fresh tensor (the caller's, nothing else holds it) to the check's sum: the first
        becomes the sum itself (no copy: the check of a 100M model held two tensors per weight
        for a moment, issue 30)."""
        if self.check is not None and self.wants_check(name):
            c = self.check.get(name)
            if c is None:
                self.check[name] = grad_sum if grad_sum.dtype == self.dtype else grad_sum.to(self.dtype)
            else:  # in place: the check's tensor is its own
                c.add_(grad_sum.to(self.dtype))

    def add_check_rows(self, name: str, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Add rows (U, d) at positions index (U,) of the check's (V, d) sum (an embedding's
        lookups): into the sum when it exists, no table-sized temporary."""
        if self.check is None or not self.wants_check(name):
            return
        c = self.check.get(name)
        if c is None:
            c = self.check[name] = torch.zeros(self.shapes[name], dtype=self.dtype, device=rows.device)
        c.index_add_(0, index, rows.to(self.dtype))

    def wants_check(self, name: str) -> bool:
        return self.check is not None and (self.check_names is None or name in self.check_names)

    def unallocated_bytes(self) -> int:
        """What the sums will take once every parameter's first square arrived (compact: a
        float32 total and an int16 fraction, 6 bytes per coordinate)."""
        per = 6 if self.compact else self.n_groups * self.dtype.itemsize
        return per * sum(int(torch.Size(s).numel()) for n, s in self.shapes.items() if n not in self.sums) \
            if self.squares else 0

    def needs(self, name: str) -> bool:
        """Whether this store keeps anything of the parameter (a check pass over a group of the
        parameters skips the others' per-row work)."""
        return self.squares or self.wants_check(name)

    def finish(self) -> dict[str, torch.Tensor]:
        """name -> (n_groups, *shape); groups (or parameters) no row reached are zero. A compact
        store's halves are materialised here (finish_halves hands them over without that)."""
        if self.compact:
            return self.finish_halves().stacked()
        out = {}
        for name, shape in self.shapes.items():
            cur = self.sums.pop(name, None)
            out[name] = cur if cur is not None else torch.zeros((self.n_groups, *shape), dtype=self.dtype,
                                                                 device=self.device)
        return out

    def finish_halves(self) -> HalfSums:
        """The two groups as HalfSums (n_groups == 2), handed over without copies."""
        if self.n_groups != 2:
            raise ValueError(f"n_groups: finish_halves needs 2 groups, got {self.n_groups}")
        total, diff = {}, {}
        for name, shape in self.shapes.items():
            if self.compact:
                t, q = self.sums.pop(name, None), self.frac.pop(name, None)
                total[name] = t if t is not None else torch.zeros(shape, dtype=self.dtype, device=self.device)
                diff[name] = q if q is not None else torch.zeros(shape, dtype=torch.int16, device=self.device)
            else:
                g = self.sums.pop(name, None)
                if g is None:
                    g = torch.zeros((2, *shape), dtype=self.dtype, device=self.device)
                total[name], diff[name] = g[0] + g[1], g[0] - g[1]
        rounds = max(self.rounds.values(), default=0) if self.compact else 0
        self.rounds.clear()
        return HalfSums(total, diff, rounds)


class _RowsOf:
    """flat[sel] sliced by columns without copying every selected row at once: _RowsOf(f, sel)[:, sl]
    is f[sel][:, sl] (the rows of a group, read a slice at a time)."""

    def __init__(self, flat: torch.Tensor, sel: torch.Tensor):
        self.flat, self.sel = flat, sel
        self.shape = (sel.numel(), flat.shape[1])

    def __getitem__(self, key: tuple[slice, slice]) -> torch.Tensor:
        return self.flat[:, key[1]][self.sel]


def _update(t: torch.Tensor, q: torch.Tensor, parts: list[tuple[int, torch.Tensor]],
            rows: bool = False, first: bool = False) -> None:
    """Add parts [(group k, sq)] (flat, like t) to the compact sums: the float32 total t and the
    int16 fraction q of the difference A - B (group 0 counts +, group 1 -), one slice of
    UPDATE_CHUNK values at a time (temporaries of a slice, never of the whole tensor).
    rows=True: each part is (group k, per-row gradients (b, numel)), squared and summed over its
    rows slice by slice (no (numel,) square sum, no copy of the rows).
    first=True: t and q hold nothing yet (allocated empty): the parts are written, not added."""
    step = UPDATE_CHUNK if not rows else max(1, UPDATE_CHUNK // max(1, max(p.shape[0] for _, p in parts)))
    for o in range(0, t.numel(), step):
        sl = slice(o, o + step)
        tc = t[sl]
        # q' = round((q T + S (A' - B')) / T'), with T' = T + A' + B': eight operations a value
        num = None if first else q[sl].float().mul_(tc)  # S x the difference so far
        for k, sq in parts:
            s = sq[sl].to(t.dtype) if not rows else sq[:, sl].square().sum(0, dtype=t.dtype)
            if num is None:  # the first part of a fresh sum (the total itself when adopted)
                num = s.mul(FRAC_SCALE if k == 0 else -FRAC_SCALE)
                if s.data_ptr() != tc.data_ptr():
                    tc.copy_(s)
                continue
            tc.add_(s)
            num.add_(s, alpha=FRAC_SCALE if k == 0 else -FRAC_SCALE)
        assert num is not None  # parts is never empty (add_groups / add_row_squares return first)
        # |num| <= S T' (every square >= 0), so the quotient fits int16; 0 / 0 (no mass yet) -> 0
        q[sl] = num.div_(tc).round_().nan_to_num_(0.0)


class Accumulator:
    """One forward pass: its rows' groups, the uses of each parameter, per-row buffers of shared
    parameters (per-row gradients summed over all uses before squaring)."""

    def __init__(self, store: Store, groups: torch.Tensor, budget_bytes: int):
        self.store = store
        self.groups = groups  # (B,) long on the device
        self.budget = budget_bytes
        self.uses: dict[str, int] = {}
        self.kinds: dict[str, list[str]] = {}
        self.lookups: dict[str, torch.Tensor] = {}  # tied embedding -> its lookup's ids (B, T)
        self.tied: dict[str, dict[str, torch.Tensor]] = {}  # the head's part, until the lookup's
        self.early: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # a lookup's, head not yet
        self.arrived: dict[str, int] = {}
        self.rows: dict[str, torch.Tensor] = {}
        present = sorted(set(groups.tolist()))
        # (group, row index or None = all rows) for every group present in the pass
        self.selections: list[tuple[int, torch.Tensor | None]] = (
            [(present[0], None)] if len(present) == 1
            else [(k, (groups == k).nonzero().squeeze(1)) for k in present])

    def used(self, names: list[tuple[str, str]], module: nn.Module | None = None,
             lookup: tuple[torch.Tensor, float] | None = None) -> None:
        """Forward time: a module call will send gradients for these parameters (its kind and an
        embedding lookup's ids recorded for `tied_head`)."""
        if isinstance(module, nn.Embedding) and lookup is not None and [k for k, _ in names] == ["weight"]:
            kind = "embedding"
            self.lookups[names[0][1]] = lookup[0]
        elif isinstance(module, nn.Linear) and not ps.is_conv1d(module):
            kind = "linear"
        else:
            kind = "other"
        for key, name in names:
            self.uses[name] = self.uses.get(name, 0) + 1
            self.kinds.setdefault(name, []).append(kind if key == "weight" else "other")

    def shared(self, name: str) -> bool:
        return self.uses[name] > 1

    def tied_head(self, name: str) -> bool:
        """A weight used once as an embedding lookup and once as a linear layer (a tied
        embedding and output head): summed without a per-row buffer (module docstring)."""
        return self.uses.get(name) == 2 and sorted(self.kinds.get(name, ())) == ["embedding", "linear"]

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
        if not self.store.needs(name):
            return
        if self.shared(name):
            self.row_buffer(name)[rows] += grads
            return
        self._add_squares(name, rows, grads, in_place=False)

    def _add_squares(self, name: str, rows: slice, grads: torch.Tensor, in_place: bool) -> None:
        if self.store.wants_check(name):
            self.store.add_check(name, grads.sum(0))
        if self.store.compact:  # squared slice by slice into the sums
            grp = self.groups[rows]
            sels = [(k, None if len(self.selections) == 1 else (grp == k).nonzero().squeeze(1))
                    for k in sorted(set(grp.tolist()))]
            self.store.add_row_squares(name, grads, sels)
            return
        if len(self.selections) == 1:
            self.store.add(name, self.selections[0][0], ps.square_sum(grads, in_place=in_place))
            return
        grp = self.groups[rows]
        self.store.add_groups(name, [(k, ps.square_sum(grads[grp == k])) for k in sorted(set(grp.tolist()))])

    def use_done(self, name: str) -> None:
        self.arrived[name] = self.arrived.get(name, 0) + 1
        if self.shared(name) and self.arrived[name] == self.uses[name]:
            self._flush(name)

    def _flush(self, name: str) -> None:
        buf = self.rows.pop(name, None)
        if buf is not None:
            self._add_squares(name, slice(0, buf.shape[0]), buf, in_place=True)

    def pending(self, name: str) -> bool:
        """Whether per-row gradients of this parameter are still held back in this pass (a
        shared parameter's buffer, a tied head's part waiting for its lookup's or the other way
        round): what has reached the store for it is not yet all."""
        return name in self.rows or name in self.tied or name in self.early

    def finish_pass(self) -> None:
        # uses whose gradient never arrived (outputs not connected to the loss) contribute zero
        for name in list(self.rows):
            self._flush(name)
        for name in list(self.tied):  # a tied head whose lookup's gradient never arrived
            _tied_squares(self, name, self.tied.pop(name), None)
        for name, (row, vocab, grad) in list(self.early.items()):  # a lookup whose head's never did
            _lookup_squares(self, name, row, vocab, grad)
        self.early.clear()
        self.uses.clear()
        self.kinds.clear()
        self.lookups.clear()
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
        if not acc.store.needs(name):
            continue
        pos, spans = ps.positions(gf)
        touched = None
        if acc.shared(name) and acc.tied_head(name):
            touched = _tied_head_use(acc, name, xf, gf)
        elif acc.shared(name):  # per-row gradients until every use arrived
            # the first use writes the buffer (no zero-fill), later ones add into it
            rows = ps.linear_row_grads(x=xf, g=gf, conv1d=conv, pos=pos, out=acc.rows.get(name))
            acc.rows[name] = rows.to(acc.store.dtype)
            continue
        if acc.store.wants_check(name):
            acc.store.add_check(name, ps.linear_grad_sum(x=xf, g=gf, conv1d=conv))
        if not acc.store.squares:
            continue
        rows_out = xf.shape[-1] if conv else gf.shape[-1]  # the weight's first dimension
        width = gf.shape[-1] if conv else xf.shape[-1]
        values = min(BLOCK_VALUES, int(acc.budget * BLOCK_BUDGET_SHARE) // (4 * max(1, len(acc.selections))))
        per_block = max(1, values // max(1, width))
        if not acc.store.compact or per_block >= rows_out:
            parts = [(k, ps.linear_square_sum(x=_pick(xf, sel), g=_pick(gf, sel), conv1d=conv, pos=_pick(pos, sel),
                                              spans=_pick(spans, sel)))
                     for k, sel in acc.selections]
            if touched is not None:  # those rows come whole with the lookup's part
                for _, sq in parts:
                    sq[touched] = 0
            acc.store.add_groups(name, parts, owned=True)
            continue
        # a large weight (an untied lm_head: vocab x hidden): its squares a block of rows at a
        # time, so the temporaries are a block's, not the weight's (issue 30)
        for r0 in range(0, rows_out, per_block):
            blk = slice(r0, min(rows_out, r0 + per_block))
            parts = []
            for k, sel in acc.selections:
                xs, gs = _pick(xf, sel), _pick(gf, sel)
                xs, gs = (xs[..., blk], gs) if conv else (xs, gs[..., blk])
                parts.append((k, ps.linear_square_sum(x=xs, g=gs, conv1d=conv, pos=_pick(pos, sel),
                                                      spans=_pick(spans, sel))))
            if touched is not None:
                inside = touched[(touched >= blk.start) & (touched < blk.stop)] - blk.start
                for _, sq in parts:
                    sq[inside] = 0
            acc.store.add_block(name, blk, parts)
        acc.store.block_done(name)


def _tied_head_use(acc: Accumulator, name: str, xf: torch.Tensor, gf: torch.Tensor) -> torch.Tensor | None:
    """The output head's use of a tied embedding: keeps its gradient at the vocabulary rows the
    batch's tokens touch (g[..., touched]: (B, T, U), U <= B x T, not vocab x hidden a row) for
    `_tied_squares`, and returns those rows (sorted), whose squares the head's sum leaves out."""
    ids = acc.lookups.get(name)
    if ids is None or not acc.store.squares:
        return None
    touched = torch.unique(ids.reshape(-1).to(gf.device))
    part = {"touched": touched, "g": gf[..., touched].contiguous(), "x": xf}
    early = acc.early.pop(name, None)
    if early is not None:  # the lookup's gradient came first (not the usual order of a backward)
        _tied_squares(acc, name, part, early)
    else:
        acc.tied[name] = part
    return touched


def _tied_squares(acc: Accumulator, name: str, part: dict[str, torch.Tensor],
                  lookup: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """The squares of a tied weight's touched rows: per row n, (H_n + E_n)^2 at those rows, with
    H_n = g_n^T x_n (the head's gradient there) and E_n the lookup's sparse gradient (row, vocab,
    grad from persample.embedding_row_grads; None when it never arrived: H_n alone)."""
    touched, g, x = part["touched"], part["g"], part["x"]
    st = acc.store
    where = None if lookup is None else torch.searchsorted(touched, lookup[1])
    parts = []
    for k, sel in acc.selections:
        rows = range(g.shape[0]) if sel is None else sel.tolist()
        out = torch.zeros((touched.numel(), x.shape[-1]), dtype=st.dtype, device=g.device)
        for n in rows:
            h = (g[n].transpose(0, 1) @ x[n]).to(st.dtype)  # (U, d): H_n at the touched rows
            if lookup is not None and where is not None:
                mine = (lookup[0] == n).nonzero().squeeze(1)
                h.index_add_(0, where[mine], lookup[2][mine].to(st.dtype))
            out.addcmul_(h, h)
        parts.append((k, touched, out))
    st.index_add_groups(name, parts)


def _embedding(acc: Accumulator, call: Call) -> None:
    mod = call.module
    assert isinstance(mod, nn.Embedding) and call.lookup is not None
    (_, name), = call.names
    if not acc.store.needs(name):
        return
    ids, scale = call.lookup
    V = mod.num_embeddings
    row, vocab, grad = ps.embedding_row_grads(ids=ids, g=wide(call.g), num_embeddings=V,
                                              scale=scale, padding_idx=mod.padding_idx)
    st = acc.store
    if acc.shared(name) and not acc.tied_head(name):
        acc.row_buffer(name).view(-1, grad.shape[-1]).index_add_(0, row * V + vocab, grad)
        return
    if st.wants_check(name):
        st.add_check_rows(name, vocab, grad)
    if not st.squares:
        return
    if acc.tied_head(name):  # the touched rows' squares, whole, once both parts are here
        part = acc.tied.pop(name, None)
        if part is None:
            acc.early[name] = (row, vocab, grad)
        else:
            _tied_squares(acc, name, part, (row, vocab, grad))
        return
    _lookup_squares(acc, name, row, vocab, grad)


def _lookup_squares(acc: Accumulator, name: str, row: torch.Tensor, vocab: torch.Tensor,
                    grad: torch.Tensor) -> None:
    """An embedding lookup's squares alone (its rows' sparse gradients (U, d) at vocab (U,))."""
    sq = grad.square()  # (U, d)
    if len(acc.selections) == 1:
        acc.store.index_add(name, acc.selections[0][0], vocab, sq)
        return
    grp = acc.groups[row]
    acc.store.index_add_groups(name, [(k, vocab[grp == k], sq[grp == k]) for k, _ in acc.selections])


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
