"""The Cauchy-Schwarz bound of docs/science.md section 3, checked per coordinate on real samples.

For N completions y_n with advantages A_n and per-sample score vectors s_n = grad log p(y_n | x_n)
(gradient of the summed completion log-prob, the `sequence` Fisher estimator's sample):

    g_i = mean_n A_n s_{n,i}          (the policy gradient of the first GRPO step, sequence form)
    |g_i| <= sqrt(E[A^2]) * sqrt(F_i)

The headline check uses a Fisher F estimated from INDEPENDENT samples (other prompts, or other
completions of the same prompts; `summarize(res, fisher=...)`), so it can fail: the result reports
the violations, the distribution of the ratio |g_i| / (sqrt(mean A^2) sqrt(F_i)) and how tight the
bound is. With F from the SAME samples (mean_n s_{n,i}^2, kept in BoundResult.fisher) the
inequality is Cauchy-Schwarz on the empirical measure and holds by construction: that identity is
reported only as a numerical self-check (`identity_*` keys), never as evidence.

The reported g is the sequence form. GRPO's default token-mean loss divides by the number T of
completion tokens of the batch instead of by N, so its gradient is g_train = (N/T) g_seq (up to
the sign of a loss to minimise); `bound_n_over_t` is that constant. A coordinate counts as
holding when lhs <= rhs * (1 + rtol) + atol. Sums are accumulated in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from compute.contract.cost import BOUND_CORR_COORDS, BOUND_UNIT
from compute.contract.jobresult import Heatmap, Progress, SeriesPoint


@dataclass
class BoundResult:
    lhs: Mapping[str, torch.Tensor]  # |g_i| per parameter (float64)
    rhs: Mapping[str, torch.Tensor]  # sqrt(mean A^2) * sqrt(F_i)
    fisher: Mapping[str, torch.Tensor]  # F_i on the same samples
    n_samples: int
    rms_advantage: float
    summary: dict[str, Any] = field(default_factory=dict)
    n_tokens: int = 0  # completion tokens T of the N samples (token-mean loss: g_train = N/T g)
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # a part of a parameter: its flat range


def bound_terms(
    sum_ag: torch.Tensor, sum_g2: torch.Tensor, sum_a2: float, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(|g|, rhs, F) from running sums over n samples: sum_n A_n s_n, sum_n s_n^2, sum_n A_n^2."""
    fisher = sum_g2 / n
    return (sum_ag / n).abs(), math.sqrt(sum_a2 / n) * fisher.sqrt(), fisher


class _Terms(Mapping):
    """name -> one of bound_terms' three tensors (0: |g|, 1: the bound, 2: F), made from the running
    sums on access, one parameter at a time (issue 30: the three held for every coordinate were
    24 bytes/param beside the sums' 16)."""

    def __init__(self, sum_ag: dict[str, torch.Tensor], sum_g2: dict[str, torch.Tensor], sum_a2: float,
                 n: int, which: int):
        self.sum_ag, self.sum_g2, self.sum_a2, self.n, self.which = sum_ag, sum_g2, sum_a2, n, which

    def __getitem__(self, name: str) -> torch.Tensor:
        return bound_terms(self.sum_ag[name], self.sum_g2[name], self.sum_a2, self.n)[self.which]

    def __iter__(self) -> Any:
        return iter(self.sum_ag)

    def __len__(self) -> int:
        return len(self.sum_ag)


def holds(lhs: torch.Tensor, rhs: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-12) -> torch.Tensor:
    """Bool tensor: lhs <= rhs * (1 + rtol) + atol (float error allowance relative to the RHS)."""
    return lhs <= rhs * (1 + rtol) + atol


def bound_from_sample_grads(
    grads: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(|g|, rhs, F), each (P,), from per-sample scores grads (N, P) and advantages (N,)."""
    g = grads.double()
    a = advantages.double()
    return bound_terms((a[:, None] * g).sum(0), (g * g).sum(0), float((a * a).sum()), len(a))


def accumulate_sample_grads(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    progress: Progress | None = None,
    pieces: list[tuple[str, int, int]] | None = None,
) -> BoundResult:
    """Per-sample gradients of the summed completion log-prob, one backward per row (N small).

    input_ids, attention_mask, completion_mask: (N, L) right-padded rows; advantages: (N,).
    Memory: two float64 buffers per parameter; each row's gradient of a parameter is folded into
    them as autograd finishes it and dropped (a post-accumulate-grad hook), so the rows' gradients
    are never all alive (issue 30: 4 bytes/param, and a float64 copy of each, were).

    `pieces`: (name, lo, hi) flat coordinate ranges, at most one a parameter: only these are
    folded (a group of bound_check's; default every coordinate of every trainable parameter, the
    sums in each parameter's shape; a part of one is a flat range, BoundResult.ranges). Parameters
    without a piece are frozen for the backward (requires_grad off, put back after), so autograd
    computes no gradient for them and stops below the earliest parameter of the group.
    """
    from compute.lm.sampling import token_logprobs

    every = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ranges = {n: (0, p.numel()) for n, p in every.items()} if pieces is None else {}
    for n, lo, hi in pieces or []:
        if n not in every:
            raise ValueError(f"pieces: {n!r} is not a trainable parameter of the model")
        if not 0 <= lo < hi <= every[n].numel() or n in ranges:
            raise ValueError(f"pieces: {n!r} [{lo}, {hi}) is not one range within its {every[n].numel()} coordinates")
        ranges[n] = (lo, hi)
    params = {n: p for n, p in every.items() if n in ranges}
    frozen = [p for n, p in every.items() if n not in ranges]
    whole = {n for n, (lo, hi) in ranges.items() if hi - lo == every[n].numel()}

    def zeros(n: str) -> torch.Tensor:
        p = params[n]
        shape = p.shape if n in whole else (ranges[n][1] - ranges[n][0],)
        return torch.zeros(shape, dtype=torch.float64, device=p.device)

    sum_ag = {n: zeros(n) for n in params}
    sum_g2 = {n: zeros(n) for n in params}
    adv = advantages.double().cpu()
    N = len(adv)
    row = [0.0]  # the advantage of the row being folded
    held = {n: p.grad for n, p in params.items()}  # a caller's gradients, put back afterwards

    def fold(n: str) -> Any:
        def hook(p: torch.nn.Parameter) -> None:
            g = p.grad
            if g is None:
                return
            g = g.reshape(-1)
            if n not in whole:
                g = g[ranges[n][0]:ranges[n][1]]
            # into float64 a slice at a time: each float32 value promoted once, then same-dtype
            # arithmetic (the mixed-dtype in-place ops promoted it twice, unvectorised: 2.5x the
            # time in a one-off timing on this CPU, not committed;
            # time), the same bits
            ag, g2 = sum_ag[n].view(-1), sum_g2[n].view(-1)
            for o in range(0, g.numel(), SLICE):
                c = g[o:o + SLICE].to(torch.float64)
                ag[o:o + SLICE].add_(c, alpha=row[0])
                g2[o:o + SLICE].addcmul_(c, c)
            p.grad = None
        return hook

    was_training = model.training
    model.eval()  # deterministic forward (no dropout) like the sampler's
    handles = [p.register_post_accumulate_grad_hook(fold(n)) for n, p in params.items()]
    for p in frozen:
        p.requires_grad_(False)
    try:
        for p in params.values():
            p.grad = None
        for i in range(N):
            width = int(attention_mask[i].sum())
            ids, am = input_ids[i : i + 1, :width], attention_mask[i : i + 1, :width]
            lp = token_logprobs(model, ids, am)[:, 1:]  # (1, width-1)
            seq = (lp * completion_mask[i : i + 1, 1:width].to(lp.dtype)).sum()
            row[0] = float(adv[i])
            seq.backward()
            if progress and (i + 1) % max(1, N // 20) == 0:
                progress((i + 1) / N, f"per-sample gradients {i + 1}/{N}")
    finally:
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(True)
        for n, p in params.items():
            p.grad = held[n]
        model.train(was_training)
    sum_a2 = float((adv * adv).sum())
    lhs, rhs, fisher = (_Terms(sum_ag, sum_g2, sum_a2, N, k) for k in range(3))
    n_tokens = int(sum(int((completion_mask[i, 1 : int(attention_mask[i].sum())]).sum()) for i in range(N)))
    return BoundResult(lhs, rhs, fisher, N, math.sqrt(sum_a2 / max(1, N)), n_tokens=n_tokens,
                       ranges={n: r for n, r in ranges.items() if n not in whole})


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank), float64."""
    xs, order = torch.sort(x)
    n = len(x)
    ranks_sorted = torch.arange(n, dtype=torch.float64)
    _, inverse, counts = torch.unique_consecutive(xs, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() + 1) / 2  # 0-based mean rank of each tie block
    ranks_sorted = mean_rank[inverse]
    out = torch.empty(n, dtype=torch.float64)
    out[order] = ranks_sorted
    return out


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    den = torch.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / den) if den > 0 else float("nan")


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    return pearson(_ranks(x.double().cpu()), _ranks(y.double().cpu()))


RATIO_QUANTILES = (0.5, 0.9, 0.99, 0.999)
MAX_POINTS, MAX_CORR = 3000, BOUND_CORR_COORDS  # the scatter's and the correlations' samples of coordinates


# coordinates per slice of the summary's passes (issue 30: the summary flattened every coordinate
# in float64, four times, and sorted the ratios: about 120 bytes/param of an 8B model)
SLICE = BOUND_UNIT  # compute.contract.cost.bound_plan cuts a parameter into groups at multiples of it
RATIO_EDGES = [0.0, 1e-3, 1e-2, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, math.inf]
# a bin of the order-statistic selection this small is sorted outright (8 MiB of float64)
SELECT_SORT_MAX = 1 << 20


def _order_stats(passes: Any, ranks: list[int]) -> dict[int, float]:
    """rank (0-based) -> the rank-th smallest of non-negative float64 values, exactly, from
    `passes()` (each call yields the same values again, a 1-D tensor at a time): a radix select on
    the values' bits (they order as the values do), 16 bits a pass, until a rank's bin holds at
    most SELECT_SORT_MAX values, which one more pass collects and sorts. Temporaries: a slice."""
    state = {r: [0, 0, r] for r in set(ranks)}  # rank -> [prefix, bits known, rank within the prefix]
    out: dict[int, float] = {}
    counts: dict[int, int] = {}  # rank -> values in its bin (known after a histogram pass)
    while len(out) < len(state):
        hist = {r: torch.zeros(1 << 16, dtype=torch.int64) for r in state
                if r not in out and counts.get(r, SELECT_SORT_MAX + 1) > SELECT_SORT_MAX and state[r][1] < 64}
        collect: dict[int, list[torch.Tensor]] = {r: [] for r in state if r not in out and r not in hist}
        for v in passes():
            v = v.double().contiguous()  # float32 values are exact in float64, in the same order
            k = v.view(torch.int64)
            for r, h in hist.items():
                prefix, known, _ = state[r]
                sel = k if known == 0 else k[(k >> (64 - known)) == prefix]
                if sel.numel():
                    h += torch.bincount(((sel >> (48 - known)) & 0xFFFF).cpu(), minlength=1 << 16)
            for r, got in collect.items():
                prefix, known, _ = state[r]
                got.append(v[(k >> (64 - known)) == prefix].cpu() if known else v.cpu())
        for r, h in hist.items():
            prefix, known, within = state[r]
            below = torch.cumsum(h, 0) - h  # values in lower bins
            b = int(((below <= within) & (h > 0)).nonzero().max())
            state[r] = [(prefix << 16) | b, known + 16, within - int(below[b])]
            counts[r] = int(h[b])
            if known + 16 == 64:  # every value of the bin is this one
                out[r] = float(torch.tensor([state[r][0]], dtype=torch.int64).view(torch.float64)[0])
        for r, got in collect.items():
            vals = torch.sort(torch.cat(got)).values
            out[r] = float(vals[state[r][2]])
    return {r: out[r] for r in ranks}


# The ratio's quantiles when its slices cannot be made again (bound_check in groups: each group's
# sums are dropped once summarised): a histogram of the float64 ratio's bits, the exponent and the
# top FINE_MANTISSA_BITS of the mantissa, over [2^-FINE_OCTAVES, 2^FINE_OCTAVES) plus a bin below
# and one above. A quantile is then known to its bin: the middle reported, half a bin (a relative
# 2^-(FINE_MANTISSA_BITS + 1) = 6.1e-5 of the value) its stated error. 2^20 int64 bins: 8 MiB.
FINE_MANTISSA_BITS = 13
FINE_OCTAVES = 64
_FINE_SHIFT = 52 - FINE_MANTISSA_BITS
_FINE_BASE = (1023 - FINE_OCTAVES) << FINE_MANTISSA_BITS  # the key of 2^-FINE_OCTAVES
_FINE_BINS = (2 * FINE_OCTAVES) << FINE_MANTISSA_BITS


def _fine_key(v: torch.Tensor) -> torch.Tensor:
    """Bin of each non-negative float64 value: 0 below 2^-FINE_OCTAVES (zero too), 1 + the bin of
    the value's top bits, _FINE_BINS + 1 at or above 2^FINE_OCTAVES (infinity too)."""
    return (v.contiguous().view(torch.int64) >> _FINE_SHIFT).sub_(_FINE_BASE - 1).clamp_(0, _FINE_BINS + 1)


def _fine_edges(b: int) -> tuple[float, float]:
    """[lo, hi) of bin b of _fine_key."""
    def at(key: int) -> float:
        return float(torch.tensor([(key + _FINE_BASE) << _FINE_SHIFT], dtype=torch.int64).view(torch.float64)[0])
    if b == 0:
        return 0.0, at(0)
    if b == _FINE_BINS + 1:
        return at(_FINE_BINS), math.inf
    return at(b - 1), at(b)


def _ones(n: int) -> torch.Tensor:
    """n int64 ones without n values in memory (index_add_'s counts)."""
    return torch.ones(1, dtype=torch.int64).expand(n)


class _RatioStats:
    """ratio_stats over (lhs, rhs) slices handed over one at a time (`add`), then `result(again)`
    with `again()` making the same slices again for the ratio's exact quantiles; without `again`
    (slices made once) the quantiles come from a fine histogram of the ratio, bracketed to a
    relative 6.1e-5 (`ratio_quantiles_exact` False, `ratio_quantile_rel_error`). `quantiles` False:
    no quantiles (the same-sample identity reports none)."""

    def __init__(self, rtol: float, atol: float, quantiles: bool = True):
        self.rtol, self.atol = rtol, atol
        self.fine = torch.zeros(_FINE_BINS + 2, dtype=torch.int64) if quantiles else None
        self.zeros = 0
        self.n = self.violations = self.zero_rhs = self.m = self.above_05 = self.above_01 = 0
        self.max, self.sum = -math.inf, 0.0
        self.hist = torch.zeros(len(RATIO_EDGES) - 1, dtype=torch.int64)
        self.edges = torch.tensor(RATIO_EDGES[1:-1], dtype=torch.float64)

    @staticmethod
    def ratios(lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        live = rhs > 0
        return lhs[live] / rhs[live]

    def add(self, lhs: torch.Tensor, rhs: torch.Tensor) -> None:
        # holds() counted in place (one temporary: the allowance), a ratio over every coordinate
        # when the bound is positive everywhere (the masked selects were half of this pass)
        allowed = torch.mul(rhs, 1 + self.rtol).add_(self.atol)
        self.n += lhs.numel()
        self.violations += lhs.numel() - int(torch.le(lhs, allowed).count_nonzero())  # a bool sum casts first (4.5x, one-off)
        del allowed
        live = rhs > 0
        if bool(live.all()):
            ratio = lhs / rhs
        else:
            self.zero_rhs += int(((~live) & (lhs > self.atol)).count_nonzero())
            ratio = lhs[live] / rhs[live]
        del live
        self.m += ratio.numel()
        if not ratio.numel():
            return
        self.max = max(self.max, float(ratio.max()))
        if self.fine is None:  # the identity: its counts and largest ratio only
            return
        self.sum += float(ratio.sum())
        self.above_05 += int((ratio > 0.5).count_nonzero())
        self.above_01 += int((ratio > 0.1).count_nonzero())
        # the coarse histogram from counts at or above each edge (a bucketize was twice the time);
        # a NaN ratio (a NaN gradient) in the last bin, as bucketize put it
        at_least = [int((ratio >= e).count_nonzero()) for e in RATIO_EDGES[1:-1]]
        nan = int(ratio.isnan().count_nonzero())
        counts = [ratio.numel() - nan - at_least[0]] + [at_least[i] - at_least[i + 1] for i in range(len(at_least) - 1)] \
            + [at_least[-1] + nan]
        self.hist += torch.tensor(counts, dtype=torch.int64)
        k = _fine_key(ratio.double()).cpu()
        self.fine.index_add_(0, k, _ones(k.numel()))
        self.zeros += int((ratio == 0).count_nonzero())  # the smallest ranks, exactly (a zero gradient)

    def _bracketed(self, ranks: list[int]) -> tuple[dict[int, float], float]:
        """rank -> the middle of the fine bin that holds the rank-th smallest ratio, and the largest
        half-width of those bins relative to their middle (0 where a bin holds one value only)."""
        assert self.fine is not None
        ends = torch.cumsum(self.fine, 0)
        out, err = {}, 0.0
        for r in ranks:
            if r < self.zeros:  # ratios are >= 0: the smallest ranks are the exact zeros
                out[r] = 0.0
                continue
            b = int(torch.searchsorted(ends, torch.tensor(r), right=True))
            lo, hi = _fine_edges(b)
            hi = min(hi, self.max)  # the largest ratio is known exactly
            lo = min(lo, hi)
            mid = (lo + hi) / 2 if math.isfinite(hi) else lo
            out[r] = mid
            if hi > lo and mid > 0:
                err = max(err, (hi - lo) / 2 / mid)
        return out, err

    def result(self, again: Any = None) -> dict[str, Any]:
        n, m = self.n, self.m
        out: dict[str, Any] = {
            "coordinates": n,
            "violations": self.violations,
            "violation_fraction": self.violations / n if n else float("nan"),
            "fraction_holds": (n - self.violations) / n if n else float("nan"),
            "zero_rhs_violations": self.zero_rhs,
            "ratio_coordinates": m,
        }
        if m and self.fine is not None:
            ranks = [min(m - 1, int(math.ceil(q * m)) - 1) for q in RATIO_QUANTILES]
            if again is not None:
                qs, err = _order_stats(lambda: (self.ratios(lhs, rhs) for lhs, rhs in again()), ranks), 0.0
            else:
                qs, err = self._bracketed(ranks)
            out["ratio_quantiles"] = {f"p{q * 100:g}": qs[r] for q, r in zip(RATIO_QUANTILES, ranks, strict=True)}
            out["ratio_quantiles_exact"] = again is not None
            out["ratio_quantile_rel_error"] = err
        if m:
            out["ratio_max"] = self.max
            # tightness: how close the largest gradients come to the bound
            if self.fine is not None:
                out["ratio_mean"] = self.sum / m
                out["ratio_above_0.5"] = self.above_05 / m
                out["ratio_above_0.1"] = self.above_01 / m
                out["ratio_histogram"] = {"edges": RATIO_EDGES[:-1] + ["inf"],
                                          "counts": [int(c) for c in self.hist.tolist()]}
        return out


def ratio_stats(lhs: torch.Tensor, rhs: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-12
                ) -> dict[str, Any]:
    """Violations and the distribution of lhs / rhs over coordinates (flat float64 tensors).

    Quantiles are the lower empirical quantiles: the ceil(q * n)-th smallest ratio.

    A coordinate with rhs == 0 and lhs > atol is a violation with an infinite ratio (counted apart);
    one with lhs == rhs == 0 is excluded from the ratio distribution. summarize streams the same
    statistics over slices (_RatioStats)."""
    st = _RatioStats(rtol, atol)
    st.add(lhs, rhs)
    return st.result(lambda: iter([(lhs, rhs)]))


class _Sample:
    """A uniform sample without replacement of `size` of the coordinates (all of them when there
    are no more), drawn slice by slice: each coordinate a uniform key, the `size` smallest kept
    (the running set at most twice `size`). `indices()`: their positions, ascending; `values()`:
    the values handed to `add` at those positions, in the same order (kept as they are drawn, so
    the coordinates' slices need to be made only once)."""

    def __init__(self, size: int, gen: torch.Generator):
        self.size, self.gen = size, gen
        self.keys = torch.empty(0)
        self.index = torch.empty(0, dtype=torch.int64)
        self.vals: dict[str, torch.Tensor] = {}
        # candidates since the last prune, joined then (a join per slice copied the whole running
        # set each time: most of the summary's pass at 2M candidates)
        self.new: list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
        self.count = 0
        self.below = 2.0  # once `size` keys are kept, a key at or above their largest never enters

    def add(self, offset: int, n: int, values: Mapping[str, torch.Tensor] | None = None,
            u: torch.Tensor | None = None) -> None:
        """The coordinates offset .. offset + n - 1, with their `values`; `u`: their keys when the
        caller draws them (one draw shared by two samples: the smaller nested in the larger)."""
        u = torch.rand(n, generator=self.gen) if u is None else u
        new = torch.nonzero(u < self.below).flatten()
        if not new.numel():
            return
        self.new.append((u[new], new + offset, {k: v[new.to(v.device)].cpu() for k, v in (values or {}).items()}))
        self.count += new.numel()
        if self.count > 2 * self.size:
            self._prune()

    def _join(self) -> None:
        if not self.new:
            return
        self.keys = torch.cat([self.keys] + [k for k, _, _ in self.new])
        self.index = torch.cat([self.index] + [i for _, i, _ in self.new])
        for name in self.new[0][2]:
            old = [self.vals[name]] if name in self.vals else []
            self.vals[name] = torch.cat(old + [v[name] for _, _, v in self.new])
        self.new = []

    def _prune(self) -> None:
        self._join()
        if self.keys.numel() > self.size:
            # the `size` smallest keys: the size-th smallest by selection, then the keys below it
            # and, in order, as many equal to it as the size needs (a top-k was 3.6x the time, one-off timing)
            cut = torch.kthvalue(self.keys, self.size).values
            below = self.keys < cut
            need = self.size - int(below.count_nonzero())
            keep = torch.cat([below.nonzero().flatten(), (self.keys == cut).nonzero().flatten()[:need]])
            self.keys, self.index = self.keys[keep], self.index[keep]
            self.vals = {k: v[keep] for k, v in self.vals.items()}
            self.below = float(cut)
        self.count = self.keys.numel()

    def _order(self) -> torch.Tensor:
        self._prune()
        return torch.argsort(self.index)

    def indices(self) -> torch.Tensor:
        order = self._order()
        return self.index[order]

    def values(self) -> dict[str, torch.Tensor]:
        order = self._order()
        return {k: v[order] for k, v in self.vals.items()}


# the log grid's fine bins (counted in one pass, merged into the figure's bins at the end):
# LOG_FINE per decade over [LOG_LO, LOG_HI) decades of |g| and sqrt(F), values outside clamped in
LOG_FINE, LOG_LO, LOG_HI = 16, -40, 24


class _LogHist:
    """Counts of coordinates on a log10 |g| (rows) x log10 sqrt(F) (columns) grid, streamed in one
    pass (bound_check's groups make each slice once): counted on a fixed grid of 1/LOG_FINE decade
    (8 MiB), the figure's `bins` x `bins` grid made at the end from whole fine bins spanning the
    values' extent (its edges on multiples of 1/LOG_FINE decade). |g| below the grid's lowest edge
    (a zero gradient) counts in its lowest row."""

    def __init__(self, bins: int = 24):
        self.bins = bins
        self.x_min = self.y_min_real = math.inf
        self.x_max = self.y_max = -math.inf
        n = (LOG_HI - LOG_LO) * LOG_FINE
        self.fine = torch.zeros(n, n, dtype=torch.int64)

    @staticmethod
    def _log(v: torch.Tensor) -> torch.Tensor:
        """log10 of each value in float32 (a 1/16-decade grid needs no more; a third of the time
        of float64's), 1e-30 and below at -30, a NaN below the grid."""
        return v.float().clamp_(min=1e-30).log10_().nan_to_num_(nan=LOG_LO - 1.0)

    @classmethod
    def _xy(cls, lhs: torch.Tensor, sqf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cls._log(sqf), cls._log(lhs)

    @staticmethod
    def _cell(v: torch.Tensor) -> torch.Tensor:
        n = (LOG_HI - LOG_LO) * LOG_FINE
        # truncation is the floor once clamped at 0; n - 0.5 truncates to the last cell
        return (v - LOG_LO).mul_(LOG_FINE).clamp_(0, n - 0.5).to(torch.int64).cpu()

    def add(self, lhs: torch.Tensor, sqf: torch.Tensor) -> None:
        if not lhs.numel():
            return
        x, y = self._xy(lhs, sqf)
        x_lo, x_hi = torch.aminmax(x)
        self.x_min, self.x_max = min(self.x_min, float(x_lo)), max(self.x_max, float(x_hi))
        self.y_max = max(self.y_max, float(y.max()))
        real = float(torch.where(y > -30, y, math.inf).min())  # a zero |g| is not the extent's
        if real < math.inf:
            self.y_min_real = min(self.y_min_real, real)
        n = self.fine.shape[0]
        cell = self._cell(y).mul_(n).add_(self._cell(x))
        self.fine.view(-1).index_add_(0, cell, _ones(cell.numel()))

    def heatmap(self, independent: bool) -> Heatmap:
        lo = min(self.x_min, self.y_min_real) if self.y_min_real < math.inf else self.x_min
        hi = max(self.x_max, self.y_max)
        n = self.fine.shape[0]
        lo_f = int(self._cell(torch.tensor([lo], dtype=torch.float64))[0])
        hi_f = min(n, int(self._cell(torch.tensor([hi], dtype=torch.float64))[0]) + 1)
        w = max(1, -(-(hi_f - lo_f) // self.bins))  # fine bins per figure bin
        span = self.bins * w
        grid = torch.zeros(span + lo_f, span + lo_f, dtype=torch.int64)
        top = min(n, span + lo_f)
        grid[:top, :top] = self.fine[:top, :top]
        grid[lo_f] += grid[:lo_f].sum(0)  # |g| below the lowest edge: the lowest row
        counts = grid[lo_f:, lo_f:].reshape(self.bins, w, self.bins, w).sum((1, 3))
        edges = [LOG_LO + (lo_f + k * w) / LOG_FINE for k in range(self.bins + 1)]
        labels = [f"{(edges[i] + edges[i + 1]) / 2:.2f}" for i in range(self.bins)]
        return Heatmap(
            name="bound_log_hist",
            x_labels=labels,
            y_labels=labels,
            z=[[float(v) if v > 0 else None for v in row] for row in counts.tolist()],
            meta={"x": "log10 sqrt(F_i)", "y": "log10 |g_i|", "value": "coordinates",
                  "fisher": "independent samples" if independent else "same samples (identity)",
                  "bin_decades": w / LOG_FINE,
                  "note": "the bound is the line y = x + log10(rms A); points above it are violations"},
        )


def _slices(res: BoundResult, names: list[str], fisher: Mapping[str, torch.Tensor] | None,
            size: int, start: int = 0) -> Any:
    """One pass over every coordinate in slices of `size`, in the gradient's parameter order:
    (offset, |g|, the same-sample bound, sqrt F same, sqrt F independent or None), float64 on the
    CPU; offsets count from `start` (a group's first coordinate in the model's order). Terms made
    from the running sums (_Terms) are made a slice at a time. A part of a parameter
    (BoundResult.ranges) is sliced from its own start: the slices are the whole parameter's when
    its parts begin at multiples of `size` (bound_plan's `unit`)."""
    offset = start
    for n in names:
        parts: list[torch.Tensor]
        if isinstance(res.lhs, _Terms):  # |g|, the bound and F from the sums, a slice at a time
            parts = [res.lhs.sum_ag[n].reshape(-1), res.lhs.sum_g2[n].reshape(-1)]
        else:
            parts = [x[n].reshape(-1) for x in (res.lhs, res.rhs, res.fisher)]
        numel = parts[0].numel()
        lo = res.ranges.get(n, (0, numel))[0]  # a part of the parameter: its flat range
        ind = fisher[n].reshape(-1)[lo:lo + numel] if fisher is not None else None
        for o in range(0, numel, size):
            cut = [x[o:o + size] for x in parts]
            made = bound_terms(cut[0], cut[1], res.lhs.sum_a2, res.lhs.n) if isinstance(res.lhs, _Terms) else cut
            lhs, rhs, f = (x.double().cpu() for x in made)
            sqf_ind = ind[o:o + size].cpu().double().clamp(min=0).sqrt() if ind is not None else None
            yield offset + o, lhs, rhs, f.sqrt(), sqf_ind
        offset += numel


class _Summary:
    """summarize's statistics, counted in one pass over the coordinates' slices (`add`), in the
    model's parameter order; `finish` makes the headline, the scatter and the grid. The same
    object takes a whole BoundResult's slices (summarize) or a group's at a time (bound_check),
    and gives the same numbers both ways: the samples are drawn by position, the counts add up;
    only the ratio's quantiles differ (exact when the slices can be made again, else bracketed)."""

    def __init__(self, rms_advantage: float, rtol: float, independent: bool, max_points: int,
                 max_corr: int, seed: int):
        gen = self.gen = torch.Generator().manual_seed(seed)
        self.rms, self.independent = rms_advantage, independent
        self.ident, self.indep = _RatioStats(rtol, 1e-12, quantiles=False), _RatioStats(rtol, 1e-12)
        self.corr, self.pick = _Sample(max_corr, gen), _Sample(max_points, gen)
        self.grid = _LogHist()
        self.total = 0

    def add(self, o: int, lhs: torch.Tensor, rhs: torch.Tensor, sqf_same: torch.Tensor,
            sqf_ind: torch.Tensor | None) -> None:
        self.total += lhs.numel()
        self.ident.add(lhs, rhs)
        sqf = sqf_ind if sqf_ind is not None else sqf_same
        p_rhs = rhs
        if sqf_ind is not None:
            p_rhs = self.rms * sqf_ind
            self.indep.add(lhs, p_rhs)
        live = sqf > 0
        if bool(live.all()):
            self.grid.add(lhs, sqf)
        else:
            self.grid.add(lhs[live], sqf[live])
        del live
        u = torch.rand(lhs.numel(), generator=self.gen)  # one draw: the scatter's sample nested in the correlations'
        self.corr.add(o, lhs.numel(), {"lhs": lhs, "sqf": sqf, "same": sqf_same}, u)
        self.pick.add(o, lhs.numel(), {"lhs": lhs, "sqf": sqf, "rhs": p_rhs}, u)

    def finish(self, res: BoundResult, again: Any, fisher_info: Mapping[str, Any] | None,
               aggregation: str) -> tuple[dict[str, Any], list[SeriesPoint], list[Heatmap]]:
        """`again()`: the same slices once more (the exact quantiles' passes), None where they
        cannot be made again."""
        empty = torch.empty(0, dtype=torch.float64)
        c, p = self.corr.values(), self.pick.values()
        c = {k: c.get(k, empty) for k in ("lhs", "sqf", "same")}
        p = {k: p.get(k, empty) for k in ("lhs", "sqf", "rhs")}
        ident_st = self.ident.result()
        n_over_t = res.n_samples / res.n_tokens if res.n_tokens else float("nan")
        summary: dict[str, Any] = {
            "bound_samples": res.n_samples,
            "bound_tokens": res.n_tokens,
            "bound_rms_advantage": res.rms_advantage,
            "bound_constant": res.rms_advantage,
            "bound_coordinates": self.total,
            "bound_rtol": self.ident.rtol,
            "bound_gradient": "sequence form g = mean_n A_n grad log p(y_n | x_n) on the first GRPO batch",
            "bound_n_over_t": n_over_t,
            "bound_n_over_t_note": (
                "token-mean loss: training gradient = (N/T) x the reported g" if aggregation == "token"
                else "sequence-mean loss: each sample is weighted by 1/T_n, not a constant multiple of g"),
            "identity_fraction_holds": ident_st["fraction_holds"],
            "identity_violations": ident_st["violations"],
            "identity_max_ratio": ident_st.get("ratio_max", 0.0),
            "identity_note": "Fisher from the same samples: holds by construction (a self-check only)",
            "grad_sqrt_fisher_same_spearman": spearman(c["lhs"], c["same"]),
            "bound_independent": self.independent,
        }
        if self.independent:
            rms = self.rms
            st = self.indep.result(None if again is None else
                                   lambda: ((lhs, rms * sqf_ind) for _, lhs, _, _, sqf_ind in again()))
            summary.update({
                "bound_fisher": dict(fisher_info or {}),
                "bound_fraction_holds": st["fraction_holds"],
                "bound_violations": st["violations"],
                "bound_violation_fraction": st["violation_fraction"],
                "bound_zero_fisher_violations": st["zero_rhs_violations"],
                "bound_ratio_quantiles": st.get("ratio_quantiles", {}),
                "bound_ratio_quantiles_exact": st.get("ratio_quantiles_exact", True),
                "bound_ratio_quantile_rel_error": st.get("ratio_quantile_rel_error", 0.0),
                "bound_max_ratio": st.get("ratio_max", float("nan")),
                "bound_median_ratio": st.get("ratio_quantiles", {}).get("p50", float("nan")),
                "bound_mean_ratio": st.get("ratio_mean", float("nan")),
                "bound_ratio_above_0.5": st.get("ratio_above_0.5", float("nan")),
                "bound_ratio_histogram": st.get("ratio_histogram", {}),
                "grad_sqrt_fisher_pearson": pearson(c["lhs"], c["sqf"]),
                "grad_sqrt_fisher_spearman": spearman(c["lhs"], c["sqf"]),
            })
        order = torch.argsort(p["sqf"])
        series = [SeriesPoint("bound/|grad|", float(p["sqf"][i]), float(p["lhs"][i])) for i in order.tolist()]
        series += [SeriesPoint("bound/rhs", float(p["sqf"][i]), float(p["rhs"][i])) for i in order.tolist()]
        heatmaps = [self.grid.heatmap(self.independent)] if self.grid.x_min < math.inf else []
        return summary, series, heatmaps


def summarize(
    res: BoundResult,
    rtol: float = 1e-5,
    fisher: Mapping[str, torch.Tensor] | None = None,
    fisher_info: Mapping[str, Any] | None = None,
    max_points: int = MAX_POINTS,
    max_corr: int = MAX_CORR,
    seed: int = 0,
    aggregation: str = "token",
) -> tuple[dict[str, Any], list[SeriesPoint], list[Heatmap]]:
    """Headline numbers, a downsampled scatter (|g| against sqrt(F)) and a log-binned 2-D histogram.

    fisher: a Fisher estimated from samples independent of the gradient's (the headline check;
    fisher_info describes where it came from). Without it the summary says that no independent
    check was made (`bound_independent` False) and reports only the same-sample identity, which
    cannot fail. The scatter and histogram use the independent Fisher when given.

    Streamed (issue 30): every statistic is counted over slices of SLICE coordinates in one pass
    (_Summary; the ratios' exact quantiles by a radix select over more passes, the correlations and
    the scatter on uniform samples of max_corr and max_points coordinates), so its memory is a
    slice's, not the ~120 bytes/param of flattening every term in float64 and sorting."""
    names = list(res.lhs)
    _check_fisher(names, fisher)
    acc = _Summary(res.rms_advantage, rtol, fisher is not None, max_points, max_corr, seed)
    for part in _slices(res, names, fisher, SLICE):
        acc.add(*part)
    return acc.finish(res, lambda: _slices(res, names, fisher, SLICE), fisher_info, aggregation)


def _check_fisher(names: list[str], fisher: Mapping[str, torch.Tensor] | None) -> None:
    if fisher is not None:
        missing = [n for n in names if n not in fisher]
        if missing:
            raise ValueError(f"fisher: parameter {missing[0]!r} of the gradient is not in the Fisher")


def _first_batch(model: torch.nn.Module, tokenizer: Any, task: Any, prompts: int, group: int,
                 max_new_tokens: int, seed: int, scale_std: bool, temperature: float) -> tuple[Any, torch.Tensor, float]:
    """The first GRPO batch (train prompts 0..prompts-1, seed as in compute.train): the sampled
    rows, their group advantages from the task reward, the mean reward."""
    from compute.lm.sampling import sample_completions
    from compute.train.objectives.grpo import group_advantages

    examples = task.examples(prompts, seed=seed, split="train", start=0)
    roll = sample_completions(model, tokenizer, [e.prompt for e in examples], samples=group,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              seed=seed * 1_000_003)
    rewards = torch.tensor([float(task.reward(c, examples[i].answer))
                            for c, i in zip(roll.completions, roll.prompt_index.tolist(), strict=True)])
    return roll, group_advantages(rewards, roll.prompt_index.cpu(), scale_std), float(rewards.mean())


def first_step_bound(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    prompts: int = 8,
    group: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    scale_std: bool = True,
    temperature: float = 1.0,
    progress: Progress | None = None,
) -> BoundResult:
    """Sample the first GRPO batch (train prompts 0..prompts-1, seed as in compute.train), compute
    group advantages from the task reward, and accumulate the per-sample bound terms."""
    roll, adv, mean_reward = _first_batch(model, tokenizer, task, prompts, group, max_new_tokens, seed,
                                          scale_std, temperature)
    res = accumulate_sample_grads(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                                  adv, progress)
    res.summary["bound_mean_reward"] = mean_reward
    return res


def bound_check(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    groups: list[list[tuple[str, int, int]]] | None = None,
    fisher: Mapping[str, torch.Tensor] | None = None,
    fisher_info: Mapping[str, Any] | None = None,
    aggregation: str = "token",
    prompts: int = 8,
    group: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    scale_std: bool = True,
    temperature: float = 1.0,
    rtol: float = 1e-5,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], list[SeriesPoint], list[Heatmap]]:
    """first_step_bound then summarize, in groups of coordinates: the batch sampled once, then per
    group (pieces (name, lo, hi) of parameters, consecutive in the model's order and together every
    coordinate of every trainable parameter, a large one split at multiples of SLICE; None: one
    group of all) one backward per row folding only that group's sums, summarised and dropped
    before the next (compute.contract.cost.bound_plan sizes the groups to the device). The sums'
    memory is the largest group's, the time a backward per row per group. Every number equals the
    one-group check's except the ratio's quantiles, bracketed to a stated relative error when there
    is more than one group (the sums are gone by the time the quantiles' bins are known)."""
    sizes = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    order = list(sizes)
    groups = [[(n, 0, sizes[n]) for n in order]] if groups is None else groups
    flat = [piece for g in groups for piece in g]
    want, at = [], {n: 0 for n in order}
    for n, lo, hi in flat:  # each parameter covered from 0 to its end, in order, slice-aligned cuts
        want.append(n)
        if n not in at or lo != at[n] or hi <= lo or (hi != sizes[n] and hi % SLICE):
            raise ValueError("groups: must cover every coordinate of every trainable parameter once, "
                             "consecutively in the model's order, a parameter cut only at multiples of "
                             f"{SLICE:,} coordinates")
        at[n] = hi
    if [n for i, n in enumerate(want) if i == 0 or want[i - 1] != n] != order or any(at[n] != sizes[n] for n in order):
        raise ValueError("groups: must cover every coordinate of every trainable parameter once, "
                         "consecutively in the model's order")
    _check_fisher(order, fisher)
    roll, adv, mean_reward = _first_batch(model, tokenizer, task, prompts, group, max_new_tokens, seed,
                                          scale_std, temperature)
    starts, o = {}, 0
    for n in order:
        starts[n], o = o, o + sizes[n]
    acc: _Summary | None = None
    res: BoundResult | None = None
    for k, pieces in enumerate(groups):
        def step(f: float, m: str = "", k: int = k) -> None:
            if progress:
                progress((k + f) / len(groups), f"group {k + 1}/{len(groups)}: {m}" if len(groups) > 1 else m)
        whole = len(groups) == 1
        res = accumulate_sample_grads(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                                      adv, step, pieces=None if whole else pieces)
        if acc is None:
            acc = _Summary(res.rms_advantage, rtol, fisher is not None, MAX_POINTS, MAX_CORR, 0)
        for n, lo, _hi in pieces:
            for part in _slices(res, [n], fisher, SLICE, starts[n] + lo):
                acc.add(*part)
        if not whole:
            res = BoundResult({}, {}, {}, res.n_samples, res.rms_advantage, n_tokens=res.n_tokens)  # drop the sums
    assert acc is not None and res is not None
    last = res
    again = (lambda: _slices(last, order, fisher, SLICE)) if len(groups) == 1 else None
    summary, series, heat = acc.finish(res, again, fisher_info, aggregation)
    summary["bound_mean_reward"] = mean_reward
    summary["bound_groups"] = len(groups)
    summary["bound_group_largest_coordinates"] = max(sum(hi - lo for _, lo, hi in g) for g in groups)
    return summary, series, heat
