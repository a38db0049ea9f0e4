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
    lhs: dict[str, torch.Tensor]  # |g_i| per parameter (float64)
    rhs: dict[str, torch.Tensor]  # sqrt(mean A^2) * sqrt(F_i)
    fisher: dict[str, torch.Tensor]  # F_i on the same samples
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
    Memory: two float64 buffers per parameter.
    """
    from compute.lm.sampling import token_logprobs

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sum_ag = {n: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for n, p in params.items()}
    sum_g2 = {n: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for n, p in params.items()}
    adv = advantages.double().cpu()
    N = len(adv)
    was_training = model.training
    model.eval()  # deterministic forward (no dropout) like the sampler's
    try:
        for i in range(N):
            width = int(attention_mask[i].sum())
            ids, am = input_ids[i : i + 1, :width], attention_mask[i : i + 1, :width]
            lp = token_logprobs(model, ids, am)[:, 1:]  # (1, width-1)
            seq = (lp * completion_mask[i : i + 1, 1:width].to(lp.dtype)).sum()
            grads = torch.autograd.grad(seq, list(params.values()), allow_unused=True)
            for (n, _p), g in zip(params.items(), grads, strict=True):
                if g is None:
                    continue
                g = g.double()
                sum_ag[n].add_(g, alpha=float(adv[i]))
                sum_g2[n].addcmul_(g, g)
            if progress and (i + 1) % max(1, N // 20) == 0:
                progress((i + 1) / N, f"per-sample gradients {i + 1}/{N}")
    finally:
        model.train(was_training)
    sum_a2 = float((adv * adv).sum())
    lhs, rhs, fisher = {}, {}, {}
    for n in params:
        lhs[n], rhs[n], fisher[n] = bound_terms(sum_ag[n], sum_g2[n], sum_a2, N)
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


def ratio_stats(lhs: torch.Tensor, rhs: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-12
                ) -> dict[str, Any]:
    """Violations and the distribution of lhs / rhs over coordinates (flat float64 tensors).

    Quantiles are the lower empirical quantiles: the ceil(q * n)-th smallest ratio.

    A coordinate with rhs == 0 and lhs > atol is a violation with an infinite ratio (counted apart);
    one with lhs == rhs == 0 is excluded from the ratio distribution.
    """
    ok = holds(lhs, rhs, rtol, atol)
    live = rhs > 0
    ratio = lhs[live] / rhs[live]
    out: dict[str, Any] = {
        "coordinates": int(len(lhs)),
        "violations": int((~ok).sum()),
        "violation_fraction": float((~ok).double().mean()) if len(lhs) else float("nan"),
        "fraction_holds": float(ok.double().mean()) if len(lhs) else float("nan"),
        "zero_rhs_violations": int(((~live) & (lhs > atol)).sum()),
        "ratio_coordinates": int(live.sum()),
    }
    if len(ratio):
        # exact quantiles by sorting (torch.quantile refuses inputs above 2^24 elements)
        srt = torch.sort(ratio).values
        qs = [srt[min(len(srt) - 1, int(math.ceil(q * len(srt))) - 1)] for q in RATIO_QUANTILES]
        out["ratio_quantiles"] = {f"p{q * 100:g}": float(v) for q, v in zip(RATIO_QUANTILES, qs, strict=True)}
        out["ratio_max"] = float(ratio.max())
        out["ratio_mean"] = float(ratio.mean())
        # tightness: how close the largest gradients come to the bound
        out["ratio_above_0.5"] = float((ratio > 0.5).double().mean())
        out["ratio_above_0.1"] = float((ratio > 0.1).double().mean())
        edges = [0.0, 1e-3, 1e-2, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, math.inf]
        counts = torch.bucketize(ratio, torch.tensor(edges[1:-1], dtype=ratio.dtype), right=True)
        hist = torch.bincount(counts, minlength=len(edges) - 1)
        out["ratio_histogram"] = {"edges": edges[:-1] + ["inf"], "counts": [int(c) for c in hist.tolist()]}
    return out


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
    """
    names = list(res.lhs)
    lhs = torch.cat([res.lhs[n].flatten().cpu() for n in names])
    rhs_same = torch.cat([res.rhs[n].flatten().cpu() for n in names])
    sqf_same = torch.cat([res.fisher[n].flatten().cpu() for n in names]).sqrt()
    gen = torch.Generator().manual_seed(seed)
    corr_idx = (torch.randperm(len(lhs), generator=gen)[:max_corr] if len(lhs) > max_corr
                else torch.arange(len(lhs)))
    ident = ratio_stats(lhs, rhs_same, rtol)
    n_over_t = res.n_samples / res.n_tokens if res.n_tokens else float("nan")
    summary: dict[str, Any] = {
        "bound_samples": res.n_samples,
        "bound_tokens": res.n_tokens,
        "bound_rms_advantage": res.rms_advantage,
        "bound_constant": res.rms_advantage,
        "bound_coordinates": int(len(lhs)),
        "bound_rtol": rtol,
        "bound_gradient": "sequence form g = mean_n A_n grad log p(y_n | x_n) on the first GRPO batch",
        "bound_n_over_t": n_over_t,
        "bound_n_over_t_note": (
            "token-mean loss: training gradient = (N/T) x the reported g" if aggregation == "token"
            else "sequence-mean loss: each sample is weighted by 1/T_n, not a constant multiple of g"),
        "identity_fraction_holds": ident["fraction_holds"],
        "identity_violations": ident["violations"],
        "identity_max_ratio": ident.get("ratio_max", 0.0),
        "identity_note": "Fisher from the same samples: holds by construction (a self-check only)",
        "grad_sqrt_fisher_same_spearman": spearman(lhs[corr_idx], sqf_same[corr_idx]),
        "bound_independent": fisher is not None,
    }
    sqf, rhs_plot = sqf_same, rhs_same
    if fisher is not None:
        sqf = _sqrt_fisher(fisher, names)
        rhs_plot = res.rms_advantage * sqf
        summary.update(_independent_summary(lhs, rhs_plot, sqf, corr_idx, rtol, fisher_info))
    live = sqf > 0
    pick = torch.randperm(len(lhs), generator=gen)[:max_points]
    pick = pick[torch.argsort(sqf[pick])]
    series = [SeriesPoint("bound/|grad|", float(sqf[i]), float(lhs[i])) for i in pick.tolist()]
    series += [SeriesPoint("bound/rhs", float(sqf[i]), float(rhs_plot[i])) for i in pick.tolist()]
    heatmaps = [_log_hist(lhs[live], sqf[live], fisher is not None)] if bool(live.any()) else []
    return summary, series, heatmaps


def _sqrt_fisher(fisher: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """sqrt of the (independent) Fisher, flattened in the gradient's parameter order."""
    missing = [n for n in names if n not in fisher]
    if missing:
        raise ValueError(f"fisher: parameter {missing[0]!r} of the gradient is not in the Fisher")
    return torch.cat([fisher[n].flatten().cpu().double().clamp(min=0) for n in names]).sqrt()


def _independent_summary(lhs: torch.Tensor, rhs: torch.Tensor, sqf: torch.Tensor, corr_idx: torch.Tensor,
                         rtol: float, fisher_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The headline check |g| <= sqrt(E A^2) sqrt(F_indep): violations, ratios, correlations."""
    st = ratio_stats(lhs, rhs, rtol)
    return {
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
        "grad_sqrt_fisher_pearson": pearson(lhs[corr_idx], sqf[corr_idx]),
        "grad_sqrt_fisher_spearman": spearman(lhs[corr_idx], sqf[corr_idx]),
    }


def _log_hist(lhs: torch.Tensor, sqf: torch.Tensor, independent: bool = False, bins: int = 24) -> Heatmap:
    """Counts of coordinates on a log10 |g| (rows) x log10 sqrt(F) (columns) grid."""
    x = sqf.clamp(min=1e-30).log10()
    y = lhs.clamp(min=1e-30).log10()
    lo = float(torch.minimum(x.min(), y[y > -30].min() if bool((y > -30).any()) else x.min()))
    hi = float(torch.maximum(x.max(), y.max()))
    hi = hi if hi > lo else lo + 1
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    xi = torch.bucketize(x, edges[1:-1])
    yi = torch.bucketize(y.clamp(min=lo), edges[1:-1])
    counts = torch.zeros(bins, bins, dtype=torch.float64).index_put_((yi, xi), torch.ones_like(x), accumulate=True)
    labels = [f"{float((edges[i] + edges[i + 1]) / 2):.2f}" for i in range(bins)]
    return Heatmap(
        name="bound_log_hist",
        x_labels=labels,
        y_labels=labels,
        z=[[float(v) if v > 0 else None for v in row] for row in counts.tolist()],
        meta={"x": "log10 sqrt(F_i)", "y": "log10 |g_i|", "value": "coordinates",
              "fisher": "independent samples" if independent else "same samples (identity)",
              "note": "the bound is the line y = x + log10(rms A); points above it are violations"},
    )


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
