"""Overlap metrics between masks and between a score (Fisher) and a target (|delta|, |gradient|).

Definitions (N coordinates, A and B boolean sets with densities p_a = |A|/N, p_b = |B|/N):
- overlap = |A & B|, overlap_frac_a = |A & B| / |A| (= precision of A against B)
- Jaccard J = |A & B| / |A | B|
- random baselines for independent uniform sets of the same sizes:
  intersection fraction E|A & B|/N = p_a * p_b (docs/science.md), and for Jaccard the ratio of the
  expectations p_a * p_b / (p_a + p_b - p_a * p_b) (what `jaccard_baseline` returns);
  `jaccard_lift` = J / baseline.
- precision@k of a score against a target set T: the fraction of the score's top-k (k = |T| by
  default, ties by position as in compute.sparsity.masks) that lies in T.
- ROC-AUC of a score for membership in T: the Mann-Whitney statistic with mid-ranks, so ties count
  one half (exact); 0.5 = chance.
- Spearman: Pearson correlation of mid-ranks.
Rank statistics sort all coordinates; above `cap` coordinates they use a deterministic uniform
sample (with replacement, seeded per parameter name) of `cap` coordinates, and say so in the output.
Per layer / module type / layer x module, the global top-k sets are restricted to the group.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from compute.sparsity.masks import group_key, n_keep, topk_mask

DEFAULT_CAP = 2_000_000


# ---------------------------------------------------------------------------------------------
# Set overlap
# ---------------------------------------------------------------------------------------------


def jaccard_baseline(p_a: float, p_b: float) -> float:
    """Jaccard of independent random sets of densities p_a, p_b: p_a*p_b / (p_a+p_b-p_a*p_b)."""
    union = p_a + p_b - p_a * p_b
    return p_a * p_b / union if union > 0 else 0.0


def set_overlap(n: int, n_a: int, n_b: int, n_ab: int) -> dict[str, float]:
    """All set metrics from counts: N, |A|, |B|, |A & B|."""
    union = n_a + n_b - n_ab
    p_a, p_b = (n_a / n, n_b / n) if n else (0.0, 0.0)
    jac = n_ab / union if union else 0.0
    base = jaccard_baseline(p_a, p_b)
    return {
        "n": float(n),
        "n_a": float(n_a),
        "n_b": float(n_b),
        "overlap": float(n_ab),
        "overlap_frac_a": n_ab / n_a if n_a else 0.0,
        "overlap_frac_b": n_ab / n_b if n_b else 0.0,
        "intersection_frac": n_ab / n if n else 0.0,
        "intersection_baseline": p_a * p_b,
        "jaccard": jac,
        "jaccard_baseline": base,
        "jaccard_lift": jac / base if base > 0 else float("nan"),
    }


def mask_overlap(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], by: str = "global"
) -> dict[str, dict[str, float]]:
    """group -> set_overlap metrics of two masks on the same parameters (groups: see group_key)."""
    counts: dict[str, list[int]] = {}
    for name in a:
        if name not in b or a[name].shape != b[name].shape:
            raise ValueError(f"mask: parameter {name!r} missing or of another shape in the second mask")
        c = counts.setdefault(group_key(name, by), [0, 0, 0, 0])
        ma, mb = a[name].bool(), b[name].to(a[name].device).bool()
        c[0] += ma.numel()
        c[1] += int(ma.sum())
        c[2] += int(mb.sum())
        c[3] += int((ma & mb).sum())
    return {g: set_overlap(*c) for g, c in counts.items()}


# ---------------------------------------------------------------------------------------------
# Rank statistics on flat tensors
# ---------------------------------------------------------------------------------------------


def midranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of a 1-D tensor, ties get the mean of their ranks. (n,) float64."""
    x = x.flatten()
    n = x.numel()
    order = torch.sort(x.double(), stable=True)
    _, counts = torch.unique_consecutive(order.values, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # last 1-based rank of each run
    run_rank = ends - (counts.double() - 1) / 2
    ranks = torch.empty(n, dtype=torch.float64, device=x.device)
    ranks[order.indices] = torch.repeat_interleave(run_rank, counts)
    return ranks


def roc_auc(score: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney AUC of `score` for `labels` (bool), ties counted as 1/2. NaN if one class is empty."""
    labels = labels.flatten().bool()
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    r = midranks(score)
    r_pos = float(r[labels.to(r.device)].sum())
    return (r_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation (Pearson of mid-ranks). NaN if either side is constant."""
    rx, ry = midranks(x), midranks(y).to(x.device)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    return float((rx * ry).sum()) / den if den > 0 else float("nan")


def precision_at_k(
    score: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], k: int | None = None
) -> float:
    """Fraction of the score's top-k coordinates that are in the target set (k = |target|)."""
    k = sum(int(t.sum()) for t in target.values()) if k is None else k
    if k == 0:
        return float("nan")
    top = topk_mask(score, k)
    return sum(int((top[n] & target[n].to(top[n].device).bool()).sum()) for n in top) / k


# ---------------------------------------------------------------------------------------------
# Score vs target, globally and per group
# ---------------------------------------------------------------------------------------------


def sample_index(name: str, numel: int, m: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    return torch.randint(0, numel, (m,), generator=g).to(device)


def score_vs_target(
    score: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    fraction: float,
    by: Iterable[str] = ("global", "layer", "module", "layer_module"),
    cap: int = DEFAULT_CAP,
    seed: int = 0,
    target_set: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Compare a score (e.g. Fisher) with a target (e.g. |delta| or |gradient|) on the same params.

    A = top `fraction` of score, B = top `fraction` of target (or `target_set` when given, e.g.
    the changed coordinates). Returns {"settings": {...}, "<by>": {group: metrics}} where metrics
    are set_overlap(A, B) restricted to the group, precision_at_k (= overlap_frac_a globally),
    roc_auc of the score for membership in B, and spearman(score, target) on the (sampled)
    coordinates of the group.
    """
    names = [n for n in score]
    for n in names:
        if n not in target or tuple(target[n].shape) != tuple(score[n].shape):
            raise ValueError(f"fisher: parameter {n!r} missing or of another shape in the target")
    total = sum(score[n].numel() for n in names)
    k = n_keep(fraction, total)
    if k == 0:
        raise ValueError(f"topk_percent: {fraction * 100:g}% keeps 0 of {total} coordinates")
    a = topk_mask({n: score[n] for n in names}, k)
    b = dict(target_set) if target_set is not None else topk_mask({n: target[n] for n in names}, k)
    sampled = total > cap
    samples = _rank_samples(score, target, b, cap if sampled else None, seed)
    out: dict[str, Any] = {
        "settings": {
            "fraction": fraction,
            "k": k,
            "n": total,
            "target": "given set" if target_set is not None else "top-k of target",
            "rank_stats_sampled": sampled,
            "rank_stats_cap": cap,
            "rank_stats_n": sum(v[0].numel() for v in samples.values()),
            "sample_seed": seed,
            "jaccard_baseline": "p_a*p_b/(p_a+p_b-p_a*p_b)",
        }
    }
    for grouping in by:
        groups: dict[str, list[str]] = {}
        for n in names:
            groups.setdefault(group_key(n, grouping), []).append(n)
        out[grouping] = {g: _group_metrics(members, a, b, samples) for g, members in groups.items()}
    return out


Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (score, target, in B), each (m,)


def _rank_samples(
    score: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    b: Mapping[str, torch.Tensor],
    cap: int | None,
    seed: int,
) -> dict[str, Sample]:
    """Per tensor, the coordinates the rank statistics see: all of them (cap None), or a seeded
    sample of about cap * numel / total (the cap spread proportionally over the tensors)."""
    total = sum(score[n].numel() for n in score)
    samples: dict[str, Sample] = {}
    for n in score:
        s, t, lab = score[n].flatten(), target[n].flatten(), b[n].flatten()
        if cap is not None:
            idx = sample_index(n, s.numel(), round_half_up_ratio(cap, s.numel(), total), seed, s.device)
            s, t, lab = s[idx], t.to(s.device)[idx], lab.to(s.device)[idx]
        samples[n] = (s.float(), t.float(), lab.bool())
    return samples


def _group_metrics(
    members: list[str],
    a: Mapping[str, torch.Tensor],
    b: Mapping[str, torch.Tensor],
    samples: Mapping[str, Sample],
) -> dict[str, float]:
    """set_overlap(A, B) on the group's coordinates, precision_at_k, and on the sampled
    coordinates the score's roc_auc for membership in B and spearman(score, target)."""
    n_g = sum(a[n].numel() for n in members)
    n_a = sum(int(a[n].sum()) for n in members)
    n_b = sum(int(b[n].sum()) for n in members)
    n_ab = sum(int((a[n] & b[n].to(a[n].device)).sum()) for n in members)
    m = set_overlap(n_g, n_a, n_b, n_ab)
    m["precision_at_k"] = m["overlap_frac_a"] if n_a else float("nan")
    s = torch.cat([samples[n][0] for n in members])
    t = torch.cat([samples[n][1].to(s.device) for n in members])
    lab = torch.cat([samples[n][2].to(s.device) for n in members])
    m["auc"] = roc_auc(s, lab)
    m["spearman"] = spearman(s, t)
    return m


def restrict(tensors: Mapping[str, torch.Tensor], mask: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The coordinates inside `mask` of each tensor, flat (compute.contract.construction: a run
    trained inside a mask is scored over the coordinates free to move). A tensor absent from the
    mask, or with nothing inside it, was frozen and is left out; the names (hence the layer and
    module groups) stay."""
    out = {}
    for n, t in tensors.items():
        m = mask.get(n)
        if m is None:
            continue
        m = m.to(t.device).bool()
        if bool(m.any()):
            out[n] = t[m]
    return out


def round_half_up_ratio(cap: int, numel: int, total: int) -> int:
    """Sample size of a tensor when `cap` coordinates are spread proportionally (at least 1)."""
    return max(1, int(math.floor(cap * numel / total + 0.5)))


def concentration(
    fisher: Mapping[str, torch.Tensor],
    targets: Mapping[str, Mapping[str, torch.Tensor]],
    fraction: float = 0.01,
    by: Iterable[str] = ("global", "layer", "module", "layer_module"),
    cap: int = DEFAULT_CAP,
) -> dict[str, Any]:
    """Does the initial Fisher pick out where the training gradients concentrate?

    targets: label -> {name: per-coordinate tensor}, e.g. "grad_sq_sum" (sum over all updates of
    g^2), "grad_abs_sum" (sum of |g|), "abs_delta" (|theta_end - theta_start|). For each target,
    score_vs_target(Fisher, target) at the top `fraction`: precision@k, ROC-AUC for the target's
    top-k set, Spearman, Jaccard lift, per grouping. Parameters absent from the Fisher (or from a
    target) are left out of that comparison and listed under "missing".
    """
    out: dict[str, Any] = {"fraction": fraction}
    for label, tgt in targets.items():
        names = [n for n in fisher if n in tgt and tuple(tgt[n].shape) == tuple(fisher[n].shape)]
        if not names:
            raise ValueError(f"fisher: no parameter in common with {label}")
        dev = fisher[names[0]].device
        res = score_vs_target({n: fisher[n].float() for n in names},
                              {n: tgt[n].float().to(dev) for n in names}, fraction, by=by, cap=cap)
        res["missing"] = sorted(set(tgt) - set(names))
        out[label] = res
    return out
