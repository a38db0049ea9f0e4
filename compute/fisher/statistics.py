"""Statistics of a diagonal Fisher: where the mass sits, how concentrated it is, how stable.
The layer x module aggregation they are tabled with is compute.lm.cells (torch-free).

Input everywhere: `fisher: dict[str, Tensor]` (name -> non-negative values of the param shape).
Outputs are plain floats / lists, and helpers turn them into compute.contract.jobresult rows.
No torch import at module level: `aggregate` and `cells_heatmap` are pure Python, imported by
the web process (app/figures) and the CLI; the tensor functions import torch when called.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from compute.contract.jobresult import Heatmap, LayerStat, SeriesPoint
from compute.lm.cells import aggregate, cells_heatmap
from compute.lm.naming import layer_index, module_type
from compute.runtime.memory import release_freed_memory

if TYPE_CHECKING:
    import torch

# share of mass in the top x fraction of coordinates, x on a log grid from 1e-5 to 1
CONCENTRATION_GRID = tuple(
    sorted({round(m * 10.0**e, 10) for e in range(-5, 0) for m in (1, 2, 5)} | {1.0})
)
def tensor_stats(fisher: dict[str, torch.Tensor]) -> list[dict]:
    """Per tensor: name, layer, module, numel, mean, max, mass (sum), share (mass / total mass).
    One pass over the values: a caller that tables them several ways (summary, to_layer_stats,
    to_heatmaps) computes them once and hands them over as `rows`."""
    import torch

    rows: list[dict[str, Any]] = []
    for name, f in fisher.items():
        # float64 sums over chunks: a float64 copy of the largest tensor (a 49k-row embedding is
        # half of a 50M model) was the job's peak (issue 30, benchmarks/peak_stacks.py)
        v = f.detach().reshape(-1)
        mass = sum(float(torch.sum(v[o:o + CHUNK], dtype=torch.float64)) for o in range(0, v.numel(), CHUNK))
        rows.append({
            "name": name, "layer": layer_index(name), "module": module_type(name),
            "numel": f.numel(), "mass": mass,
            "max": float(v.max()) if f.numel() else 0.0,
        })
    total = sum(r["mass"] for r in rows)
    for r in rows:
        r["mean"] = r["mass"] / r["numel"] if r["numel"] else 0.0
        r["share"] = r["mass"] / total if total > 0 else 0.0
    return rows


def layer_module_stats(fisher: dict[str, torch.Tensor], rows: list[dict] | None = None) -> list[dict]:
    """Per (layer, module type): numel, mass, mean (mass / numel), max, share of total mass.

    Sorted by layer (None = embeddings, final norm, lm_head: last) then MODULE_TYPES order."""
    rows = [{"param": r["name"], "layer": r["layer"], "module": r["module"],
             "values": {k: r[k] for k in ("numel", "mass", "max", "share")}}
            for r in (rows if rows is not None else tensor_stats(fisher))]
    return [{"layer": layer, "module": module, **c} for (layer, module), c in aggregate(rows).items()]


# Memory (issue 30): a Fisher is as large as the model, so no statistic over all coordinates
# copies the values: sums are float64 over chunks of CHUNK values, the top-k threshold is a
# streaming radix select, the Gini and the concentration curve come from a streaming histogram
# (ValueHistogram). Measured before: a full torch sort (values + int64 indices) and float64
# copies of the sorted values, cumsum and ranks, about 40 bytes per parameter at the peak; then
# one sorted float32 copy (4 bytes per parameter).
CHUNK = 1 << 20


class ValueHistogram:
    """Counts and float64 sums of all values in 65,536 bins of the high 16 bits of their
    order-preserving key (_order_keys): one streaming pass, no copy of the values (issue 30: the
    sorted float32 copy the Gini and the concentration curve needed was 4 bytes/param).

    A bin holds the values between two floats whose bits differ in the low 16 only (7 of the 23
    mantissa bits fixed: a relative width of at most 2^-7). The concentration shares are exact
    (a second pass resolves the bins that hold a cut to single values); the Gini coefficient is
    bracketed: within a bin the rank-weighted sum is between its value with equal values and that
    plus (bin width) x c^2 / 8 (Chebyshev's sum inequality), so gini_bounds() holds the exact Gini.
    The width is the bin's own (its edges) unless that leaves the bracket wider than GINI_REFINE
    (values on a few levels: many equal values in a bin), then its smallest and largest value,
    found by one more pass (issue 30: keeping them in every pass, two scatters a value, was half
    of the histogram's time, and continuous values gain nothing from them: bench_stat_ops.py)."""

    def __init__(self, fisher: Mapping[str, Any], counts: Any, sums: Any,
                 low_keys: Any = None, high_keys: Any = None):
        self.fisher, self.counts, self.sums = fisher, counts, sums
        # the smallest and largest order key (_order_keys) in each bin, once a pass found them
        self.low_keys, self.high_keys = low_keys, high_keys
        self.n = int(counts.sum())
        self.total = float(sums.sum())
        self._top: dict[int, float] = {}  # k -> sum of the k largest, once computed

    @classmethod
    def empty(cls, fisher: Mapping[str, Any] | Any) -> ValueHistogram:
        """No values yet (add them a chunk at a time with `add`); `fisher` gives the same values
        again, in the same order, for top_sums' second pass (a mapping, or an object with a
        `chunks(size)` method that makes them on the fly)."""
        import torch

        nb = 1 << 16
        return cls(fisher, torch.zeros(nb, dtype=torch.int64), torch.zeros(nb, dtype=torch.float64))

    def add(self, c: Any) -> None:
        """Count one chunk of values (a 1-D tensor)."""
        import torch

        nb = 1 << 16
        hi = _high(_order_keys(c).cpu())
        self.counts += torch.bincount(hi, minlength=nb)
        self.sums += torch.bincount(hi, weights=c.detach().double().cpu(), minlength=nb)
        self.low_keys = self.high_keys = None
        self.n = int(self.counts.sum())
        self.total = float(self.sums.sum())
        self._top.clear()

    def same(self) -> Any:
        """Bins whose values are all equal, as far as known without a pass: one value, or all
        zeros (a float64 sum of 0: the zeros' bin holds no negative value); every such bin once
        the extremes are known."""
        one = (self.counts == 1) | ((self.counts > 0) & (self.sums == 0))
        return one if self.low_keys is None else one | (self.low_keys == self.high_keys)

    def find_extremes(self) -> None:
        """One pass over the values for each bin's smallest and largest order key."""
        import torch

        nb = 1 << 16
        low = torch.full((nb,), 2**31 - 1, dtype=torch.int32)
        high = torch.full((nb,), -(2**31), dtype=torch.int32)
        for c in _chunks(self.fisher):
            key = _order_keys(c).cpu()
            hi = _high(key)
            low.scatter_reduce_(0, hi, key, "amin")
            high.scatter_reduce_(0, hi, key, "amax")
        self.low_keys, self.high_keys = low, high

    @classmethod
    def of(cls, fisher: Mapping[str, Any]) -> ValueHistogram:
        h = cls.empty(fisher)
        for c in _chunks(fisher):
            h.add(c)
        return h

    @staticmethod
    def _values(keys: Any) -> Any:
        """float64 values of int64 order keys (the inverse of _order_keys)."""
        import torch

        k = keys - _SIGN
        bits = torch.where(k >= 0, k, k ^ 0x7FFFFFFF).to(torch.int32)
        return bits.view(torch.float32).double()

    def top_sums(self, ks: Iterable[int]) -> dict[int, float]:
        """k -> exact sum of the k largest values, for every k (one more pass over the values,
        for the bins that hold a cut; remembered, so a later call for the same k makes none)."""
        ks = list(ks)
        todo = [k for k in ks if k not in self._top]
        if todo:
            self._top.update(self._top_sums(todo))
        return {k: self._top[k] for k in ks}

    def _top_sums(self, ks: Iterable[int]) -> dict[int, float]:
        import torch

        counts = self.counts.tolist()
        # values in bins strictly above each bin, and their sum
        above = torch.flip(torch.cumsum(torch.flip(self.counts, (0,)), 0), (0,)) - self.counts
        above_sum = torch.flip(torch.cumsum(torch.flip(self.sums, (0,)), 0), (0,)) - self.sums
        cuts: dict[int, tuple[int, int]] = {}  # k -> (bin of the k-th largest, values to take from it)
        for k in set(ks):
            kk = min(max(k, 0), self.n)
            if kk == 0:
                cuts[k] = (-1, 0)
                continue
            b = int(((self.counts > 0) & (above < kk)).nonzero().min())
            cuts[k] = (b, kk - int(above[b]))
        # a bin whose values are all equal (smallest key = largest: e.g. the zeros of a sparse
        # update's squared deltas) gives j of them without looking: j x that value
        same = self.same().tolist()
        need = sorted({b for b, j in cuts.values() if b >= 0 and j < counts[b] and not same[b]})
        low: dict[int, Any] = {}
        if need:
            # each value of a needed bin as (its bin's slot among `need`) x 65,536 + its low bits,
            # held until CHUNK / 16 of them (0.5 MiB), then counted bin by bin into 65,536 low-bit
            # counts each: a few compares per held value, not one per value and needed bin, and no
            # len(need) x 65,536 temporary (8 MiB at 16 cuts: 1 byte/param of a 7M model)
            slot = torch.full((1 << 16,), -1, dtype=torch.int32)
            slot[need] = torch.arange(len(need), dtype=torch.int32)
            flat = torch.zeros(len(need) << 16, dtype=torch.int64)
            held: list[Any] = []
            n_held = 0

            def count() -> None:
                idx = torch.cat(held)
                which = idx >> 16
                for i in range(len(need)):
                    m = which == i
                    if bool(m.any()):
                        flat[i << 16:(i + 1) << 16] += torch.bincount(idx[m] & 0xFFFF, minlength=1 << 16)

            for c in _chunks(self.fisher):
                key = _order_keys(c).cpu()
                at = slot.index_select(0, _high(key))
                # one scan for the positions in a needed bin (few: bins of relative width 2^-7),
                # then gathers of those alone (two masked selects were two scans)
                idx = (at >= 0).nonzero().squeeze(1)
                if not idx.numel():
                    continue
                held.append((at[idx].long() << 16) | _low(key[idx]).long())
                n_held += held[-1].numel()
                if n_held >= CHUNK // 16:
                    count()
                    held, n_held = [], 0
            if held:
                count()
            low = {b: flat[i << 16:(i + 1) << 16] for i, b in enumerate(need)}
        out: dict[int, float] = {}
        for k, (b, j) in cuts.items():
            if b < 0:
                out[k] = 0.0
                continue
            s = float(above_sum[b])
            if j >= counts[b]:
                out[k] = s + float(self.sums[b])
                continue
            if same[b]:  # j values equal to the bin's one value (c x v sums exactly in float64)
                out[k] = s + j * (float(self.sums[b]) / counts[b])
                continue
            vals = self._values((b << 16) | torch.arange(1 << 16, dtype=torch.int64))
            cnt = low[b]
            take = torch.clamp(j - (torch.flip(torch.cumsum(torch.flip(cnt, (0,)), 0), (0,)) - cnt), min=0)
            take = torch.minimum(take, cnt)
            out[k] = s + float((take.double() * vals).sum())
        return out

    def gini_bounds(self) -> tuple[float, float]:
        """(lower, upper) bound of the Gini coefficient G = 2 sum_i i x_(i) / (n S) - (n+1)/n: a
        bin of c values between lo and hi adds between 0 and (hi - lo) floor(c^2 / 8) to the
        rank-weighted sum beyond its value with all c values equal. lo, hi: the bin's edges, or
        its extremes (find_extremes) where the edges leave the bracket wider than GINI_REFINE."""
        import torch

        n, S = self.n, self.total
        if n == 0 or S <= 0:
            return 0.0, 0.0
        c = self.counts.double()
        r = torch.cumsum(c, 0) - c  # values in lower bins
        base = float(((r + (c + 1) / 2) * self.sums).sum())
        g = lambda ix: 2 * ix / (n * S) - (n + 1) / n  # noqa: E731
        while True:
            if self.low_keys is None:  # the bins' edges, as int64 unsigned keys
                b = torch.arange(1 << 16, dtype=torch.int64) << 16
                lo, hi = self._values(b), self._values(b | 0xFFFF)
            else:  # a bin's smallest and largest value (its order keys, shifted to the int64 keys of _values)
                lo, hi = self._values(self.low_keys.long() + _SIGN), self._values(self.high_keys.long() + _SIGN)
            width = torch.where((self.counts > 1) & ~self.same(), hi - lo, 0.0)
            slack = float((width * torch.floor(c * c / 8)).sum())
            lower, upper = g(base), g(base + slack)
            if self.low_keys is not None or (math.isfinite(upper) and (upper - lower) / 2 <= GINI_REFINE):
                return lower, upper
            self.find_extremes()


# gini_bounds' bins are bracketed by their edges while that keeps the Gini within this of the exact
# one (continuous values: ~1e-7 at 4M log-normal values, as with the extremes), else by their extremes
GINI_REFINE = 1e-5


def _hist(values: Any) -> ValueHistogram:
    return ValueHistogram.of(values if isinstance(values, Mapping) else {"": values})


def concentration_curve(
    fisher: Mapping[str, Any] | None = None, grid: tuple[float, ...] = CONCENTRATION_GRID,
    hist: ValueHistogram | None = None,
) -> list[tuple[float, float]]:
    """[(x, share of total mass in the top x fraction of all coordinates)] for x in grid.

    The top ceil(x * n) coordinates count (at least one). share is 0 when the total mass is 0.
    `hist`: ValueHistogram.of(fisher), when the caller already has it. Exact (streaming)."""
    h = hist if hist is not None else _hist(fisher)
    n, total = h.n, h.total
    ks = {x: min(n, max(1, math.ceil(x * n - 1e-9))) for x in grid}
    top = h.top_sums(ks.values())
    return [(float(x), top[ks[x]] / total if total > 0 else 0.0) for x in grid]


def gini(values: Any = None, hist: ValueHistogram | None = None) -> float:
    """Gini coefficient of non-negative values: 0 = all equal, -> 1 = all mass on one coordinate.

    G = 2 sum_i i x_(i) / (n sum x) - (n + 1) / n, with x sorted ascending, i = 1..n; from a
    streaming histogram: the middle of gini_bounds (within gini_error of the exact value)."""
    lo, hi = (hist if hist is not None else _hist(values)).gini_bounds()
    return (lo + hi) / 2


def gini_error(hist: ValueHistogram) -> float:
    """Half the width of the Gini bracket: |gini(...) - exact Gini| is at most this."""
    lo, hi = hist.gini_bounds()
    return (hi - lo) / 2


_SIGN = 1 << 31


def _order_keys(chunk: torch.Tensor) -> torch.Tensor:
    """float32 values -> int32 keys with the same (signed) order: the IEEE bits, the negative
    ones' magnitude bits flipped; -0.0 counted as 0.0. The unsigned key of the docs is this
    plus 2^31 (int32 arithmetic: half the memory traffic of int64 keys)."""
    import torch

    f = chunk.float().contiguous()
    bits = f.view(torch.int32)
    # a Fisher's values (no negative, no -0.0): the bits are the keys, no copy (issue 30: the
    # statistics' passes are per value; a copy per pass was a tenth of one)
    if not f.numel() or int(bits.min()) >= 0:
        return bits
    bits = (f + 0.0).view(torch.int32)  # -0.0 -> 0.0
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _high(keys: torch.Tensor) -> torch.Tensor:
    """The unsigned key's high 16 bits (0..65535) of int32 order keys, int32 (bincount,
    scatter_reduce and index_select take it: an int64 copy was a third of a histogram's time)."""
    return (keys >> 16).add_(1 << 15)


def _low(keys: torch.Tensor) -> torch.Tensor:
    return keys & 0xFFFF


def _chunks(fisher: Mapping[str, Any], size: int | None = None) -> Iterable[torch.Tensor]:
    """The values in slices of at most `size` (CHUNK), tensor by tensor in dict order. A mapping
    with a `chunks()` method (compute.fisher.accumulate.HalfView: values made on the fly;
    Reported) gives its own."""
    size = CHUNK if size is None else size
    own = getattr(fisher, "chunks", None)
    if own is not None:
        yield from own(size)
        return
    for f in fisher.values():
        v = f.detach().reshape(-1)
        for o in range(0, v.numel(), size):
            yield v[o:o + size]


class Reported(Mapping):
    """A Fisher (a mapping, or a HalfView) whose passes over its values report progress: after
    each slice, progress(lo + (hi - lo) x (passes done + share of this one) / passes, message)
    (`message`: one for every pass, or a list, one per pass).
    A statistic over all coordinates takes seconds a pass at 100M parameters on a CPU and
    minutes at 8B; without this the job's bar sat at one fraction through them (issue 30). A pass
    beyond `passes` (ties at a cut: one more) reports `hi`."""

    def __init__(self, fisher: Mapping[str, Any], progress: Any, lo: float, hi: float,
                 passes: int, message: str | list[str]):
        self.fisher, self.progress, self.lo, self.hi = fisher, progress, lo, hi
        self.passes, self.started = max(1, passes), 0
        self.messages = [message] if isinstance(message, str) else list(message)

    def __getitem__(self, name: str) -> Any:
        return self.fisher[name]

    def __iter__(self) -> Any:
        return iter(self.fisher)

    def __len__(self) -> int:
        return len(self.fisher)

    def numel(self) -> int:
        return _numel(self.fisher)

    def take(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        return _take(self.fisher, name, idx)

    def numel_of(self, name: str) -> int:
        return _numel_of(self.fisher, name)

    def chunks(self, size: int) -> Iterable[torch.Tensor]:
        k, n, done = self.started, max(1, self.numel()), 0
        self.started += 1
        message = self.messages[min(k, len(self.messages) - 1)]
        for c in _chunks(self.fisher, size):
            yield c
            done += c.numel()
            share = min(1.0, (k + done / n) / self.passes)
            self.progress(self.lo + (self.hi - self.lo) * share, message)


def _take(fisher: Mapping[str, Any], name: str, idx: torch.Tensor) -> torch.Tensor:
    """The values of one parameter at flat positions `idx`, as `_chunks` gives them (a mapping
    with a `take()` method, HalfView, makes them without the whole tensor)."""
    own = getattr(fisher, "take", None)
    if own is not None:
        return own(name, idx)
    f = fisher[name].detach().reshape(-1)
    return f[idx.to(f.device)]


def _numel(fisher: Mapping[str, Any]) -> int:
    own = getattr(fisher, "numel", None)
    return int(own()) if own is not None else sum(int(f.numel()) for f in fisher.values())


def topk_threshold(fisher: Mapping[str, Any], k: int) -> tuple[float, int]:
    """(t, g): the k-th largest value t over all coordinates and the number g of values > t.

    Streaming radix select (issue 30): two passes over the tensors in chunks of CHUNK values, a
    65,536-bin histogram of the high 16 bits of an order-preserving integer key, then of the low
    16 bits inside the bin that holds the k-th largest. Exact, and no copy of all the values
    (a float32 copy of every coordinate was 4 bytes/param on top of the two half sums)."""
    return topk_thresholds([fisher], k)[0]


def topk_thresholds(fishers: list[Mapping[str, Any]], k: int) -> list[tuple[float, int]]:
    """topk_threshold of several Fishers of the same shapes, their chunks read side by side (two
    passes in all: the split halves, made on the fly, are each made twice, not four times)."""
    import torch

    n = _numel(fishers[0])
    k = min(max(k, 1), n)
    nb = 1 << 16
    hist = [torch.zeros(nb, dtype=torch.int64) for _ in fishers]
    for cs in zip(*[_chunks(f) for f in fishers], strict=True):
        for h, c in zip(hist, cs, strict=True):
            h += torch.bincount(_high(_order_keys(c)).cpu(), minlength=nb)
    cuts = [_cut_bin(h, k) for h in hist]  # (high bin of the k-th largest, values above it)
    lows = [torch.zeros(nb, dtype=torch.int64) for _ in fishers]
    for cs in zip(*[_chunks(f) for f in fishers], strict=True):
        for low, (hi, _), c in zip(lows, cuts, cs, strict=True):
            key = _order_keys(c)
            sel = key[(key >> 16) == hi - (1 << 15)]
            if sel.numel():
                low += torch.bincount(_low(sel).cpu(), minlength=nb)
    return [_threshold(hi, above, low, k) for low, (hi, above) in zip(lows, cuts, strict=True)]


def _threshold(hi: int, above: int, low: Any, k: int) -> tuple[float, int]:
    """(t, g) of topk_threshold from the cut bin `hi`, the values in higher bins and the bin's
    low-bits histogram: t the k-th largest overall, g the values above t."""
    lo, _ = _cut_low(low, k - above)
    g = above + int(low[lo + 1:].sum())
    return _key_value(((hi << 16) | lo) - _SIGN), g


def _topk_chunk_masks(fisher: Mapping[str, Any], percent: float,
                      threshold: tuple[float, int] | None = None) -> Iterable[torch.Tensor]:
    """topk_masks' selection, one bool mask per slice of _chunks(fisher) (flat, in order).
    threshold: topk_threshold(fisher, k) when the caller has it."""
    from compute.sparsity.masks import take_ties

    k = _topk_count(fisher, percent)
    t, g = threshold if threshold is not None else topk_threshold(fisher, k)
    ties = k - g  # values equal to t still to take, in order
    for c in _chunks(fisher):
        v = c.float()
        m = v > t
        if ties > 0:
            ties = take_ties(m, v == t, ties)
        yield m


def _topk_count(fisher: Mapping[str, Any], percent: float) -> int:
    if not 0 < percent <= 100:
        raise ValueError(f"topk_percent: got {percent!r}; accepted range: (0, 100]")
    return max(1, math.ceil(_numel(fisher) * percent / 100 - 1e-9))


def topk_jaccard(a: Mapping[str, Any], b: Mapping[str, Any], percent: float) -> float:
    """Jaccard overlap |A ∩ B| / |A ∪ B| of the top-`percent`% coordinates of two Fishers.

    With a and b estimated from two independent halves of the samples, values near 1 mean the
    selected coordinates are stable (enough samples); near percent/100 means chance level.
    A positive scale of either side does not change its top-k set, so un-normalised sums serve.
    Memory: slices of CHUNK values (a or b may make theirs on the fly: HalfView), no copy.

    One pass where a sample brackets each k-th largest (_jaccard_bracketed: above about
    JACCARD_SAMPLE_MIN x JACCARD_SAMPLE_SHARE values), else two (issue 30: the statistics were
    most of a small job's time): the first finds the
    high-16-bit bin of each k-th largest value; the second resolves those bins (the low 16 bits)
    and counts the intersection at the same time: certain members on both sides outright, a
    member on one side in the other's cut bin by its low bits, a pair in both cut bins kept (few:
    two bins of relative width 2^-7). |A| = |B| = k, so the union is 2k minus the intersection.
    Where more values equal a k-th largest than the set takes (ties cut in order), or the pairs
    in both cut bins exceed CHUNK, a third pass builds the sets value by value (_topk_chunk_masks)."""
    same_shapes = hasattr(a, "chunks") or all(a[n].shape == b[n].shape for n in a)  # a HalfView pair: one shape
    if list(a) != list(b) or not same_shapes:
        raise ValueError("fisher: the two Fishers must have the same parameter names and shapes")
    import torch

    k = _topk_count(a, percent)
    if topk_jaccard_passes(_numel(a)) == 1:
        sampled = _jaccard_bracketed(a, b, k, percent)
        if sampled is not None:
            return sampled
    nb = 1 << 16
    hists = [torch.zeros(nb, dtype=torch.int64), torch.zeros(nb, dtype=torch.int64)]
    for ca, cb in zip(_chunks(a), _chunks(b), strict=True):
        hists[0] += torch.bincount(_high(_order_keys(ca)).cpu(), minlength=nb)
        hists[1] += torch.bincount(_high(_order_keys(cb)).cpu(), minlength=nb)
    cut = [_cut_bin(h, k) for h in hists]  # (high bin of the k-th largest, values in higher bins)
    (ha, _), (hb, _) = cut
    sa, sb = ha - (1 << 15), hb - (1 << 15)  # the bins as the signed high bits of int32 keys
    lows = [torch.zeros(nb, dtype=torch.int64), torch.zeros(nb, dtype=torch.int64)]
    a_cut_b_in = torch.zeros(nb, dtype=torch.int64)  # low bits of a's values in a's cut bin, b's sure
    b_cut_a_in = torch.zeros(nb, dtype=torch.int64)  # and the other way round
    pairs: list[tuple[Any, Any]] = []  # (low a, low b) of coordinates in both cut bins
    n_pairs, sure = 0, 0
    for i, (ca, cb) in enumerate(zip(_chunks(a), _chunks(b), strict=True)):
        if i % TRIM_EVERY == TRIM_EVERY - 1:  # it keeps pieces of every slice too (pairs)
            release_freed_memory()
        ka, kb = _order_keys(ca), _order_keys(cb)
        # each side's candidates (in its cut bin or above: about `percent` of the values) by one
        # compare and one scan; every count below is over candidates alone: a coordinate sure
        # on both sides, or in a's cut bin, is one of a's candidates (issue 30: six full-size
        # masks and four masked selects a chunk were most of the Jaccard's time)
        ia = (ka >= sa << 16).nonzero().squeeze(1)
        ib = (kb >= sb << 16).nonzero().squeeze(1)
        xa, ya = ka[ia], kb[ia]  # a's candidates: a's keys, b's keys there
        ta, tb = xa >> 16, ya >> 16
        in_a, on_a, in_b, on_b = ta > sa, ta == sa, tb > sb, tb == sb
        sure += int((in_a & in_b).sum())
        la = xa[on_a]
        if la.numel():
            lows[0] += torch.bincount(_low(la).cpu(), minlength=nb)
            a_cut_b_in += torch.bincount(_low(xa[on_a & in_b]).cpu(), minlength=nb)
        both = on_a & on_b
        if n_pairs <= CHUNK and bool(both.any()):
            pa, pb = _low(xa[both]).cpu(), _low(ya[both]).cpu()
            n_pairs += pa.numel()
            pairs.append((pa, pb))
        xb, yb = kb[ib], ka[ib]  # b's candidates: b's keys, a's keys there
        on_b = (xb >> 16) == sb
        lb = xb[on_b]
        if lb.numel():
            lows[1] += torch.bincount(_low(lb).cpu(), minlength=nb)
            b_cut_a_in += torch.bincount(_low(xb[on_b & ((yb >> 16) > sa)]).cpu(), minlength=nb)
    lo_a, exact_a = _cut_low(lows[0], k - cut[0][1])
    lo_b, exact_b = _cut_low(lows[1], k - cut[1][1])
    if not (exact_a and exact_b) or n_pairs > CHUNK:
        return _jaccard_by_masks(a, b, percent, _threshold(*cut[0], lows[0], k), _threshold(*cut[1], lows[1], k))
    inter = sure + int(a_cut_b_in[lo_a:].sum()) + int(b_cut_a_in[lo_b:].sum())
    for pa, pb in pairs:
        inter += int(((pa >= lo_a) & (pb >= lo_b)).sum())
    union = 2 * k - inter
    return inter / union if union else 1.0


# The split-half Jaccard's first pass (the high-bits histograms that find each k-th largest's
# bin) was half of its time and a sixth of a small job's statistics (issue 30; bench_stat_ops.py).
# A sample brackets each side's k-th largest instead: JACCARD_SAMPLE_SHARE of the values (at most
# JACCARD_SAMPLE, drawn per tensor in proportion to its size, a fixed seed), and the bracket is the
# sample's values JACCARD_Z standard deviations of the count above and below the k-th largest's
# expected rank. One pass then counts the values above the bracket and keeps those inside it (a
# few per thousand), from which the k-th largest and the intersection are exact. Whether the
# bracket holds is checked, not assumed: where it misses (odds of about 1e-12 a side at Z = 7),
# holds more than JACCARD_BAND_MAX values, or the sample is small, the two-pass path runs.
JACCARD_SAMPLE = 1 << 20
JACCARD_SAMPLE_SHARE = 256
JACCARD_SAMPLE_MIN = 1 << 12
JACCARD_Z = 7.0
JACCARD_BAND_MAX = 1 << 22
# The one pass keeps small pieces of every slice (the bands) while the slices' temporaries come
# and go: glibc's heap grew around them by 434-1,094 MiB at 360M, above the passes' peak (session
# 22). Freed memory goes back to the system every TRIM_EVERY slices: the phase then stayed under the
# passes' high-water (two one-off runs at 360M, RSS read at each progress step; the job's peak:
# benchmarks/results/bench_scale_360m_session22.json), for 10% of its time (0.38 -> 0.42 s at
# 100M values: benchmarks/ab_session22.py).
TRIM_EVERY = 32
_INT32_MAX = 2**31 - 1


def _sample_size(n: int) -> int:
    return min(JACCARD_SAMPLE, n // JACCARD_SAMPLE_SHARE)


def topk_jaccard_passes(n: int) -> int:
    """The passes topk_jaccard makes over each side of n values (one with a sample's bracket,
    two without; one more where ties at a k-th largest or a missed bracket need it)."""
    return 1 if _sample_size(n) >= JACCARD_SAMPLE_MIN else 2


def _sample_keys(fishers: list[Mapping[str, Any]], size: int) -> list[torch.Tensor]:
    """Order keys of about `size` values of each Fisher (the same positions in each), drawn per
    tensor in proportion to its size (uniform positions, a fixed seed: the result is the same on
    every run, and exact whatever the draw)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    n = _numel(fishers[0])
    parts: list[list[torch.Tensor]] = [[] for _ in fishers]
    for name in fishers[0]:
        m = _numel_of(fishers[0], name)
        draw = size * m // n
        if draw <= 0:
            continue
        # in order: the gathers walk the tensor forwards (random order was 4x the time at 20M)
        idx = torch.randint(0, m, (draw,), generator=gen).sort().values
        for p, f in zip(parts, fishers, strict=True):
            p.append(_order_keys(_take(f, name, idx)).cpu())
    return [torch.cat(p) if p else torch.zeros(0, dtype=torch.int32) for p in parts]


def _numel_of(fisher: Mapping[str, Any], name: str) -> int:
    """Values of one parameter (a mapping that makes them on the fly, HalfView, says without
    making them)."""
    own = getattr(fisher, "numel_of", None)
    return int(own(name)) if own is not None else int(fisher[name].numel())


def _bracket(keys: torch.Tensor, k: int, n: int) -> tuple[int, int] | None:
    """(lower, upper) order keys that hold the k-th largest of n values with odds of about 1e-12
    a side, from a sample's keys: values above `upper` are surely in the top k, values below
    `lower` surely not (checked after the pass). None where the sample cannot bound it below."""
    import torch

    ns = keys.numel()
    if ns == 0:
        return None
    p = k / n
    mu, sd = ns * p, math.sqrt(ns * p * (1 - p))
    hi_rank = math.floor(mu - JACCARD_Z * sd)  # the sample's hi_rank-th largest: above the k-th
    lo_rank = math.ceil(mu + JACCARD_Z * sd) + 1
    if lo_rank > ns or (lo_rank - max(hi_rank, 0)) / ns * n > JACCARD_BAND_MAX:
        return None
    def largest(r: int) -> int:  # the sample's r-th largest key (two selections, not a sort)
        return int(torch.kthvalue(keys, ns - r + 1).values)

    return largest(lo_rank), largest(hi_rank) if hi_rank >= 1 else _INT32_MAX  # none surely in


def _jaccard_bracketed(a: Mapping[str, Any], b: Mapping[str, Any], k: int, percent: float) -> float | None:
    """topk_jaccard in one pass over each side, each k-th largest bracketed by a sample; None
    where a bracket misses or holds too many values (the caller runs the two-pass path)."""
    import torch

    n = _numel(a)
    sample = _sample_keys([a, b], _sample_size(n))
    bracket_a, bracket_b = (_bracket(s, k, n) for s in sample)
    if bracket_a is None or bracket_b is None:
        return None
    (la, ua), (lb, ub) = bracket_a, bracket_b
    sure = [0, 0]
    sure_both = 0
    # each side's (keys, flat positions) inside its bracket; a's where a is in its bracket and b
    # surely in, and the other way round; the coordinates inside both brackets (keys of a, of b,
    # positions). The positions decide ties at a k-th largest (taken in flat order, as
    # _topk_chunk_masks takes them) without another pass: at 100M values two equal float32
    # values at the cut are common, and that pass was a fifth of the statistics (session 20). The
    # positions are int64 beside the int32 keys: at most 2 JACCARD_BAND_MAX of them (64 MiB)
    band: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    a_band_b_sure: list[tuple[torch.Tensor, torch.Tensor]] = []
    b_band_a_sure: list[tuple[torch.Tensor, torch.Tensor]] = []
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    held = off = 0
    for i, (ca, cb) in enumerate(zip(_chunks(a), _chunks(b), strict=True)):
        if i % TRIM_EVERY == TRIM_EVERY - 1:
            release_freed_memory()
        ka, kb = _order_keys(ca), _order_keys(cb)
        ia = (ka >= la).nonzero().squeeze(1)  # a's candidates, and b's keys there
        xa, ya = ka[ia], kb[ia]
        a_in, b_in = xa > ua, ya > ub
        a_band, b_band = ~a_in, (ya >= lb) & ~b_in
        sure[0] += int(a_in.sum())
        sure_both += int((a_in & b_in).sum())
        pa = ia + off
        band[0].append((xa[a_band].cpu(), pa[a_band].cpu()))
        sel = a_band & b_in
        a_band_b_sure.append((xa[sel].cpu(), pa[sel].cpu()))
        sel = a_in & b_band
        b_band_a_sure.append((ya[sel].cpu(), pa[sel].cpu()))
        both = a_band & b_band
        pairs.append((xa[both].cpu(), ya[both].cpu(), pa[both].cpu()))
        ib = (kb >= lb).nonzero().squeeze(1)
        xb = kb[ib]
        b_in_b = xb > ub
        sure[1] += int(b_in_b.sum())
        band[1].append((xb[~b_in_b].cpu(), (ib[~b_in_b] + off).cpu()))
        off += int(ca.numel())
        held += band[0][-1][0].numel() + band[1][-1][0].numel()
        if held > 2 * JACCARD_BAND_MAX:
            return None
    cuts: list[tuple[int, int]] = []  # each side's k-th largest key, and the last position it takes at that key
    for side in (0, 1):
        keys = torch.cat([kp[0] for kp in band[side]]) if band[side] else torch.zeros(0, dtype=torch.int32)
        need = k - sure[side]
        if not 0 < need <= keys.numel():
            return None  # the k-th largest is outside the bracket
        t = int(torch.topk(keys, need).values[-1])
        take = need - int((keys > t).sum())  # values equal to t in the set: the first ones in flat order
        at_t = torch.cat([kp[1] for kp in band[side]])[keys == t]  # their positions, ascending
        cuts.append((t, int(at_t[take - 1])))

    def member(keys: torch.Tensor, pos: torch.Tensor, cut: tuple[int, int]) -> torch.Tensor:
        return (keys > cut[0]) | ((keys == cut[0]) & (pos <= cut[1]))

    inter = sure_both + sum(int(member(x, p, cuts[0]).sum()) for x, p in a_band_b_sure) + \
        sum(int(member(y, p, cuts[1]).sum()) for y, p in b_band_a_sure) + \
        sum(int((member(x, p, cuts[0]) & member(y, p, cuts[1])).sum()) for x, y, p in pairs)
    union = 2 * k - inter
    return inter / union if union else 1.0


def _key_value(key: int) -> float:
    """The float32 value of an int32 order key (_order_keys)."""
    import struct

    bits = key if key >= 0 else key ^ 0x7FFFFFFF
    return float(struct.unpack("<f", struct.pack("<i", bits))[0])


def _cut_bin(hist: Any, k: int) -> tuple[int, int]:
    """(bin b holding the k-th largest of a high-bits histogram, values in bins above b)."""
    import torch

    above = torch.flip(torch.cumsum(torch.flip(hist, (0,)), 0), (0,))  # count in bins >= b
    b = int((above >= k).nonzero().max())
    return b, int(above[b] - hist[b])


def _cut_low(low: Any, need: int) -> tuple[int, bool]:
    """(the low bits of the need-th largest value in the cut bin, whether the values from there up
    are exactly `need`: no value equal to the k-th largest is left out by the order tie rule)."""
    import torch

    above = torch.flip(torch.cumsum(torch.flip(low, (0,)), 0), (0,))
    lo = int((above >= need).nonzero().max())
    return lo, int(above[lo]) == need


def _jaccard_by_masks(a: Mapping[str, Any], b: Mapping[str, Any], percent: float,
                      ta: tuple[float, int], tb: tuple[float, int]) -> float:
    """topk_jaccard from the sets themselves (ties at a k-th largest value cut in order), given
    both thresholds (topk_threshold): one more pass."""
    inter = union = 0
    for ma, mb in zip(_topk_chunk_masks(a, percent, ta), _topk_chunk_masks(b, percent, tb), strict=True):
        inter += int((ma & mb).sum())
        union += int((ma | mb).sum())
    return inter / union if union else 1.0


def summary(fisher: dict[str, torch.Tensor], hist: ValueHistogram | None = None,
            rows: list[dict] | None = None) -> dict:
    """Headline numbers: n_params, total mass, mean, max, gini (and its error bound), share of mass
    in the top 0.1% / 1% / 10%. `hist`: ValueHistogram.of(fisher), `rows`: tensor_stats(fisher),
    when the caller has them."""
    h = hist if hist is not None else ValueHistogram.of(fisher)
    rows = rows if rows is not None else tensor_stats(fisher)
    n = sum(r["numel"] for r in rows)
    mass = sum(r["mass"] for r in rows)
    curve = dict(concentration_curve(grid=(0.001, 0.01, 0.1), hist=h))
    return {
        "n_params": n, "total_mass": mass, "mean": mass / n if n else 0.0,
        "max": max((r["max"] for r in rows), default=0.0), "gini": gini(hist=h),
        "gini_error_bound": gini_error(h),
        "top0.1%_share": curve[0.001], "top1%_share": curve[0.01], "top10%_share": curve[0.1],
    }


# ---- compute.contract.jobresult rows --------------------------------------------------------------------


def to_layer_stats(fisher: dict[str, torch.Tensor], rows: list[dict] | None = None) -> list[LayerStat]:
    """One LayerStat per tensor (group "tensor") and per (layer, module) (group "layer_module");
    `rows`: tensor_stats(fisher), when the caller has them."""
    rows = rows if rows is not None else tensor_stats(fisher)
    out = [
        LayerStat(r["name"], r["module"], r["layer"],
                  {k: r[k] for k in ("mean", "max", "mass", "share", "numel")}, "tensor")
        for r in rows
    ]
    out += [
        LayerStat("", g["module"], g["layer"],
                  {k: g[k] for k in ("mean", "max", "mass", "share", "numel")}, "layer_module")
        for g in layer_module_stats(fisher, rows)
    ]
    return out


def to_heatmaps(fisher: dict[str, torch.Tensor], prefix: str = "fisher",
                rows: list[dict] | None = None) -> list[Heatmap]:
    """Two layer x module-type heatmaps: mean Fisher and share of total mass.

    Rows: transformer layers in order, then "-" (embeddings, final norm, lm_head) if present."""
    cells = {(g["layer"], g["module"]): g for g in layer_module_stats(fisher, rows)}
    return [cells_heatmap(f"{prefix}/{key}", cells, operator.itemgetter(key),
                          {"value": key, "units": units, "x": "module type", "y": "layer"})
            for key, units in (("mean", "mean Fisher per coordinate"), ("share", "share of total mass"))]


def to_series(fisher: dict[str, torch.Tensor], name: str = "concentration",
              hist: ValueHistogram | None = None) -> list[SeriesPoint]:
    """The concentration curve as SeriesPoint(name, x = top fraction, value = share of mass)."""
    return [SeriesPoint(name, x, s) for x, s in concentration_curve(fisher, hist=hist)]
