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
) -> BoundResult:
    """Per-sample gradients of the summed completion log-prob, one backward per row (N small).

    input_ids, attention_mask, completion_mask: (N, L) right-padded rows; advantages: (N,).
    Memory: two float64 buffers per parameter; each row's gradient of a parameter is folded into
    them as autograd finishes it and dropped (a post-accumulate-grad hook), so the rows' gradients
    are never all alive (issue 30: 4 bytes/param, and a float64 copy of each, were).
    """
    from compute.lm.sampling import token_logprobs

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sum_ag = {n: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for n, p in params.items()}
    sum_g2 = {n: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for n, p in params.items()}
    adv = advantages.double().cpu()
    N = len(adv)
    row = [0.0]  # the advantage of the row being folded
    held = {n: p.grad for n, p in params.items()}  # a caller's gradients, put back afterwards

    def fold(n: str) -> Any:
        def hook(p: torch.nn.Parameter) -> None:
            g = p.grad
            if g is None:
                return
            # in place into float64: each float32 value promoted, the same bits as a float64 copy
            sum_ag[n].add_(g, alpha=row[0])
            sum_g2[n].addcmul_(g, g)
            p.grad = None
        return hook

    was_training = model.training
    model.eval()  # deterministic forward (no dropout) like the sampler's
    handles = [p.register_post_accumulate_grad_hook(fold(n)) for n, p in params.items()]
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
        for n, p in params.items():
            p.grad = held[n]
        model.train(was_training)
    sum_a2 = float((adv * adv).sum())
    lhs, rhs, fisher = (_Terms(sum_ag, sum_g2, sum_a2, N, k) for k in range(3))
    n_tokens = int(sum(int((completion_mask[i, 1 : int(attention_mask[i].sum())]).sum()) for i in range(N)))
    return BoundResult(lhs, rhs, fisher, N, math.sqrt(sum_a2 / max(1, N)), n_tokens=n_tokens)


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


# coordinates per slice of the summary's passes (issue 30: the summary flattened every coordinate
# in float64, four times, and sorted the ratios: about 120 bytes/param of an 8B model)
SLICE = 1 << 20
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


class _RatioStats:
    """ratio_stats over (lhs, rhs) slices handed over one at a time (`add`), then `result(again)`
    with `again()` making the same slices again for the ratio's exact quantiles."""

    def __init__(self, rtol: float, atol: float):
        self.rtol, self.atol = rtol, atol
        self.n = self.violations = self.zero_rhs = self.m = self.above_05 = self.above_01 = 0
        self.max, self.sum = -math.inf, 0.0
        self.hist = torch.zeros(len(RATIO_EDGES) - 1, dtype=torch.int64)
        self.edges = torch.tensor(RATIO_EDGES[1:-1], dtype=torch.float64)

    @staticmethod
    def ratios(lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        live = rhs > 0
        return lhs[live] / rhs[live]

    def add(self, lhs: torch.Tensor, rhs: torch.Tensor) -> None:
        ok = holds(lhs, rhs, self.rtol, self.atol)
        live = rhs > 0
        self.n += lhs.numel()
        self.violations += int((~ok).sum())
        self.zero_rhs += int(((~live) & (lhs > self.atol)).sum())
        ratio = self.ratios(lhs, rhs)
        self.m += ratio.numel()
        if ratio.numel():
            self.max = max(self.max, float(ratio.max()))
            self.sum += float(ratio.sum())
            self.above_05 += int((ratio > 0.5).sum())
            self.above_01 += int((ratio > 0.1).sum())
            self.hist += torch.bincount(torch.bucketize(ratio, self.edges.to(ratio.device), right=True).cpu(),
                                        minlength=len(RATIO_EDGES) - 1)

    def result(self, again: Any) -> dict[str, Any]:
        n, m = self.n, self.m
        out: dict[str, Any] = {
            "coordinates": n,
            "violations": self.violations,
            "violation_fraction": self.violations / n if n else float("nan"),
            "fraction_holds": (n - self.violations) / n if n else float("nan"),
            "zero_rhs_violations": self.zero_rhs,
            "ratio_coordinates": m,
        }
        if m:
            ranks = [min(m - 1, int(math.ceil(q * m)) - 1) for q in RATIO_QUANTILES]
            qs = _order_stats(lambda: (self.ratios(lhs, rhs) for lhs, rhs in again()), ranks)
            out["ratio_quantiles"] = {f"p{q * 100:g}": qs[r] for q, r in zip(RATIO_QUANTILES, ranks, strict=True)}
            out["ratio_max"] = self.max
            out["ratio_mean"] = self.sum / m
            # tightness: how close the largest gradients come to the bound
            out["ratio_above_0.5"] = self.above_05 / m
            out["ratio_above_0.1"] = self.above_01 / m
            out["ratio_histogram"] = {"edges": RATIO_EDGES[:-1] + ["inf"], "counts": [int(c) for c in self.hist.tolist()]}
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
    (the running set at most twice `size`). `indices()`: their positions, ascending."""

    def __init__(self, size: int, gen: torch.Generator):
        self.size, self.gen = size, gen
        self.keys = torch.empty(0)
        self.index = torch.empty(0, dtype=torch.int64)
        self.below = 2.0  # once `size` keys are kept, a key at or above their largest never enters

    def add(self, offset: int, n: int) -> None:
        u = torch.rand(n, generator=self.gen)
        new = torch.nonzero(u < self.below).flatten()
        self.keys = torch.cat([self.keys, u[new]])
        self.index = torch.cat([self.index, new + offset])
        if self.keys.numel() > 2 * self.size:
            self._prune()

    def _prune(self) -> None:
        if self.keys.numel() > self.size:
            keep = torch.topk(self.keys, self.size, largest=False).indices
            self.keys, self.index = self.keys[keep], self.index[keep]
            self.below = float(self.keys.max())

    def indices(self) -> torch.Tensor:
        self._prune()
        return torch.sort(self.index).values


class _LogHist:
    """Counts of coordinates on a log10 |g| (rows) x log10 sqrt(F) (columns) grid, streamed: the
    range from a first pass (`extent`), the counts from a second (`add`)."""

    def __init__(self, bins: int = 24):
        self.bins = bins
        self.x_min = self.y_min_real = math.inf
        self.x_max = self.y_max = -math.inf
        self.counts = torch.zeros(bins, bins, dtype=torch.float64)
        self.edges: torch.Tensor | None = None

    @staticmethod
    def _xy(lhs: torch.Tensor, sqf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sqf.clamp(min=1e-30).log10(), lhs.clamp(min=1e-30).log10()

    def extent(self, lhs: torch.Tensor, sqf: torch.Tensor) -> None:
        if not lhs.numel():
            return
        x, y = self._xy(lhs, sqf)
        self.x_min, self.x_max = min(self.x_min, float(x.min())), max(self.x_max, float(x.max()))
        self.y_max = max(self.y_max, float(y.max()))
        real = y[y > -30]
        if real.numel():
            self.y_min_real = min(self.y_min_real, float(real.min()))

    def add(self, lhs: torch.Tensor, sqf: torch.Tensor) -> None:
        if self.edges is None:
            lo = min(self.x_min, self.y_min_real) if self.y_min_real < math.inf else self.x_min
            hi = max(self.x_max, self.y_max)
            hi = hi if hi > lo else lo + 1
            self.lo = lo
            self.edges = torch.linspace(lo, hi, self.bins + 1, dtype=torch.float64)
        if not lhs.numel():
            return
        x, y = self._xy(lhs, sqf)
        inner = self.edges[1:-1].to(x.device)
        xi, yi = torch.bucketize(x, inner).cpu(), torch.bucketize(y.clamp(min=self.lo), inner).cpu()
        self.counts.index_put_((yi, xi), torch.ones(xi.numel(), dtype=torch.float64), accumulate=True)

    def heatmap(self, independent: bool) -> Heatmap:
        assert self.edges is not None
        e = self.edges
        labels = [f"{float((e[i] + e[i + 1]) / 2):.2f}" for i in range(self.bins)]
        return Heatmap(
            name="bound_log_hist",
            x_labels=labels,
            y_labels=labels,
            z=[[float(v) if v > 0 else None for v in row] for row in self.counts.tolist()],
            meta={"x": "log10 sqrt(F_i)", "y": "log10 |g_i|", "value": "coordinates",
                  "fisher": "independent samples" if independent else "same samples (identity)",
                  "note": "the bound is the line y = x + log10(rms A); points above it are violations"},
        )


def _slices(res: BoundResult, names: list[str], fisher: Mapping[str, torch.Tensor] | None,
            size: int) -> Any:
    """One pass over every coordinate in slices of `size`, in the gradient's parameter order:
    (offset, |g|, the same-sample bound, sqrt F same, sqrt F independent or None), float64 on the
    CPU. Terms made from the running sums (_Terms) are made a slice at a time."""
    offset = 0
    for n in names:
        parts: list[torch.Tensor]
        if isinstance(res.lhs, _Terms):  # |g|, the bound and F from the sums, a slice at a time
            parts = [res.lhs.sum_ag[n].reshape(-1), res.lhs.sum_g2[n].reshape(-1)]
        else:
            parts = [x[n].reshape(-1) for x in (res.lhs, res.rhs, res.fisher)]
        numel = parts[0].numel()
        ind = fisher[n].reshape(-1) if fisher is not None else None
        for o in range(0, numel, size):
            cut = [x[o:o + size] for x in parts]
            made = bound_terms(cut[0], cut[1], res.lhs.sum_a2, res.lhs.n) if isinstance(res.lhs, _Terms) else cut
            lhs, rhs, f = (x.double().cpu() for x in made)
            sqf_ind = ind[o:o + size].cpu().double().clamp(min=0).sqrt() if ind is not None else None
            yield offset + o, lhs, rhs, f.sqrt(), sqf_ind
        offset += numel


def summarize(
    res: BoundResult,
    rtol: float = 1e-5,
    fisher: Mapping[str, torch.Tensor] | None = None,
    fisher_info: Mapping[str, Any] | None = None,
    max_points: int = 3000,
    max_corr: int = 2_000_000,
    seed: int = 0,
    aggregation: str = "token",
) -> tuple[dict[str, Any], list[SeriesPoint], list[Heatmap]]:
    """Headline numbers, a downsampled scatter (|g| against sqrt(F)) and a log-binned 2-D histogram.

    fisher: a Fisher estimated from samples independent of the gradient's (the headline check;
    fisher_info describes where it came from). Without it the summary says that no independent
    check was made (`bound_independent` False) and reports only the same-sample identity, which
    cannot fail. The scatter and histogram use the independent Fisher when given.

    Streamed (issue 30): every statistic is counted over slices of SLICE coordinates in a few
    passes (the ratios' quantiles by an exact radix select, the correlations and the scatter on
    uniform samples of max_corr and max_points coordinates), so its memory is a slice's, not the
    ~120 bytes/param of flattening every term in float64 and sorting."""
    names = list(res.lhs)
    if fisher is not None:
        missing = [n for n in names if n not in fisher]
        if missing:
            raise ValueError(f"fisher: parameter {missing[0]!r} of the gradient is not in the Fisher")

    def passes() -> Any:
        return _slices(res, names, fisher, SLICE)

    gen = torch.Generator().manual_seed(seed)
    ident, indep = _RatioStats(rtol, 1e-12), _RatioStats(rtol, 1e-12)
    corr, pick = _Sample(max_corr, gen), _Sample(max_points, gen)
    grid = _LogHist()
    total = 0
    for o, lhs, rhs, sqf_same, sqf_ind in passes():  # the first pass: counts, extents, samples
        total += lhs.numel()
        ident.add(lhs, rhs)
        sqf = sqf_ind if sqf_ind is not None else sqf_same
        if sqf_ind is not None:
            indep.add(lhs, res.rms_advantage * sqf_ind)
        live = sqf > 0
        grid.extent(lhs[live], sqf[live])
        corr.add(o, lhs.numel())
        pick.add(o, lhs.numel())
    corr_idx, pick_idx = corr.indices(), pick.indices()
    got: dict[str, list[torch.Tensor]] = {k: [] for k in ("c_lhs", "c_same", "c_sqf", "p_lhs", "p_sqf", "p_rhs")}
    for o, lhs, rhs, sqf_same, sqf_ind in passes():  # the second: the grid, the samples' values
        sqf = sqf_ind if sqf_ind is not None else sqf_same
        live = sqf > 0
        grid.add(lhs[live], sqf[live])
        for prefix, idx in (("c", corr_idx), ("p", pick_idx)):
            lo, hi = (int(torch.searchsorted(idx, x)) for x in (o, o + lhs.numel()))
            at = idx[lo:hi] - o
            got[f"{prefix}_lhs"].append(lhs[at])
            got[f"{prefix}_sqf"].append(sqf[at])
            if prefix == "c":
                got["c_same"].append(sqf_same[at])
            else:
                got["p_rhs"].append(res.rms_advantage * sqf[at] if sqf_ind is not None else rhs[at])
    v = {k: torch.cat(x) if x else torch.empty(0, dtype=torch.float64) for k, x in got.items()}
    ident_st = ident.result(lambda: ((lhs, rhs) for _, lhs, rhs, _, _ in passes()))
    n_over_t = res.n_samples / res.n_tokens if res.n_tokens else float("nan")
    summary: dict[str, Any] = {
        "bound_samples": res.n_samples,
        "bound_tokens": res.n_tokens,
        "bound_rms_advantage": res.rms_advantage,
        "bound_constant": res.rms_advantage,
        "bound_coordinates": total,
        "bound_rtol": rtol,
        "bound_gradient": "sequence form g = mean_n A_n grad log p(y_n | x_n) on the first GRPO batch",
        "bound_n_over_t": n_over_t,
        "bound_n_over_t_note": (
            "token-mean loss: training gradient = (N/T) x the reported g" if aggregation == "token"
            else "sequence-mean loss: each sample is weighted by 1/T_n, not a constant multiple of g"),
        "identity_fraction_holds": ident_st["fraction_holds"],
        "identity_violations": ident_st["violations"],
        "identity_max_ratio": ident_st.get("ratio_max", 0.0),
        "identity_note": "Fisher from the same samples: holds by construction (a self-check only)",
        "grad_sqrt_fisher_same_spearman": spearman(v["c_lhs"], v["c_same"]),
        "bound_independent": fisher is not None,
    }
    if fisher is not None:
        rms = res.rms_advantage
        st = indep.result(lambda: ((lhs, rms * sqf_ind) for _, lhs, _, _, sqf_ind in passes()))
        summary.update({
            "bound_fisher": dict(fisher_info or {}),
            "bound_fraction_holds": st["fraction_holds"],
            "bound_violations": st["violations"],
            "bound_violation_fraction": st["violation_fraction"],
            "bound_zero_fisher_violations": st["zero_rhs_violations"],
            "bound_ratio_quantiles": st.get("ratio_quantiles", {}),
            "bound_max_ratio": st.get("ratio_max", float("nan")),
            "bound_median_ratio": st.get("ratio_quantiles", {}).get("p50", float("nan")),
            "bound_mean_ratio": st.get("ratio_mean", float("nan")),
            "bound_ratio_above_0.5": st.get("ratio_above_0.5", float("nan")),
            "bound_ratio_histogram": st.get("ratio_histogram", {}),
            "grad_sqrt_fisher_pearson": pearson(v["c_lhs"], v["c_sqf"]),
            "grad_sqrt_fisher_spearman": spearman(v["c_lhs"], v["c_sqf"]),
        })
    order = torch.argsort(v["p_sqf"])
    series = [SeriesPoint("bound/|grad|", float(v["p_sqf"][i]), float(v["p_lhs"][i])) for i in order.tolist()]
    series += [SeriesPoint("bound/rhs", float(v["p_sqf"][i]), float(v["p_rhs"][i])) for i in order.tolist()]
    heatmaps = [grid.heatmap(fisher is not None)] if grid.x_min < math.inf else []
    return summary, series, heatmaps


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
    from compute.lm.sampling import sample_completions
    from compute.train.objectives.grpo import group_advantages

    examples = task.examples(prompts, seed=seed, split="train", start=0)
    roll = sample_completions(model, tokenizer, [e.prompt for e in examples], samples=group,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              seed=seed * 1_000_003)
    rewards = torch.tensor([float(task.reward(c, examples[i].answer))
                            for c, i in zip(roll.completions, roll.prompt_index.tolist(), strict=True)])
    adv = group_advantages(rewards, roll.prompt_index.cpu(), scale_std)
    res = accumulate_sample_grads(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                                  adv, progress)
    res.summary["bound_mean_reward"] = float(rewards.mean())
    return res
