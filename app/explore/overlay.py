"""Does the update land where the Fisher is large? One tensor of a diff (or series) laid over
the Fisher it was scored against.

Pure numpy, streamed in row chunks like app/explore/tensors.py. Definitions (the tests recompute
each by brute force):
- sample: SAMPLE coordinates drawn uniformly without replacement (seeded by the tensor name), or
  all of them when the tensor is smaller; the scatter shows SCATTER of them (a seeded subset).
- ROC: the Fisher as a score for two labels on the sample: "changed" (|delta| > 0) and "top-k
  |delta|" (|delta| at or above the sample's (1 - k/100) quantile, k = the result's top-k
  percent); the curve is the exact ROC of the sample (ties: one step per distinct score), the
  AUC its Mann-Whitney statistic with mid-ranks (ties count 1/2).
- maps: over the tensor view's blocks, the fraction of changed coordinates per block, of the
  tensor's top-k% |delta| coordinates (|delta| at or above the sample's quantile) and of its
  top-k% Fisher coordinates (F at or above the sample's quantile): the Fisher's drawn as an
  outline over the changed map (over the top-k |delta| map when every coordinate changed).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from app.explore.tensors import CHUNK_ELEMENTS, MAP_COLS, MAP_ROWS, Reader, as_2d, blocks

SAMPLE = 200_000
SCATTER = 3_000
ROC_POINTS = 400


def sample_index(name: str, n: int, m: int = SAMPLE) -> np.ndarray:
    """Sorted flat indices of the sample (all of range(n) when n <= m)."""
    if n <= m:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return np.sort(rng.choice(n, size=m, replace=False)).astype(np.int64)


def midrank_auc(score: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUC with mid-ranks (ties 1/2); NaN when one class is empty."""
    labels = labels.astype(bool)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="stable")
    s = score[order]
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    mid = first + (counts + 1) / 2.0  # 1-based mid-rank of each run of ties
    ranks = np.empty(score.size, dtype=np.float64)
    ranks[order] = np.repeat(mid, counts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def roc_curve(score: np.ndarray, labels: np.ndarray, max_points: int = ROC_POINTS) -> dict[str, list[float]]:
    """(false positive rate, true positive rate) at every distinct score threshold, highest
    first, thinned to about max_points points (the end points kept)."""
    labels = labels.astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return {"fpr": [], "tpr": []}
    order = np.argsort(-score, kind="stable")
    s, lab = score[order], labels[order]
    last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # the last index of each distinct score
    tp = np.cumsum(lab)[last]
    fp = (last + 1) - tp
    fpr = np.r_[0.0, fp / n_neg]
    tpr = np.r_[0.0, tp / n_pos]
    if fpr.size > max_points:
        keep = np.unique(np.r_[np.linspace(0, fpr.size - 1, max_points).round().astype(int), fpr.size - 1])
        fpr, tpr = fpr[keep], tpr[keep]
    return {"fpr": fpr.tolist(), "tpr": tpr.tolist()}


def _quantile_threshold(x: np.ndarray, k_percent: float) -> float:
    """The value at or above which the top k% of `x` lie (the k-th largest, k >= 1)."""
    k = max(1, int(math.ceil(x.size * k_percent / 100.0)))
    return float(np.partition(x, x.size - k)[x.size - k])


def overlay_stats(name: str, shape: tuple[int, ...], read_delta: Reader, read_fisher: Reader,
                  k_percent: float, chunk_elements: int = CHUNK_ELEMENTS) -> dict[str, Any]:
    """The overlay numbers of one tensor (see the module docstring); plain JSON."""
    R, C = as_2d(shape)
    n = R * C
    idx = sample_index(name, n)
    rstart, cstart = blocks(R, MAP_ROWS), blocks(C, MAP_COLS)
    rsize = int(rstart[1] - rstart[0]) if len(rstart) > 1 else R
    per_chunk = max(1, (chunk_elements // max(C, 1)) // rsize) * rsize
    csizes = np.diff(np.append(cstart, C))
    s_delta = np.empty(idx.size, dtype=np.float32)
    s_fisher = np.empty(idx.size, dtype=np.float32)
    changed_rows: list[np.ndarray] = []
    fisher_rows: list[np.ndarray] = []
    chunks = [(r0, min(R, r0 + per_chunk)) for r0 in range(0, R, per_chunk)]
    # pass 1: the sample (thresholds come from it) and the changed map
    for r0, r1 in chunks:
        d = np.asarray(read_delta(r0, r1), dtype=np.float32).reshape(r1 - r0, C)
        f = np.asarray(read_fisher(r0, r1), dtype=np.float32).reshape(r1 - r0, C)
        lo, hi = np.searchsorted(idx, [r0 * C, r1 * C])
        s_delta[lo:hi] = d.reshape(-1)[idx[lo:hi] - r0 * C]
        s_fisher[lo:hi] = f.reshape(-1)[idx[lo:hi] - r0 * C]
        changed_rows.append(_block_fraction(d > 0, r1 - r0, rsize, cstart, csizes))
    t_fisher = _quantile_threshold(s_fisher, k_percent)
    t_delta = _quantile_threshold(s_delta, k_percent)
    # pass 2: the top-k Fisher and top-k |delta| fractions per block at the sample's thresholds
    delta_rows: list[np.ndarray] = []
    for r0, r1 in chunks:
        f = np.asarray(read_fisher(r0, r1), dtype=np.float32).reshape(r1 - r0, C)
        fisher_rows.append(_block_fraction(f >= t_fisher, r1 - r0, rsize, cstart, csizes))
        d = np.asarray(read_delta(r0, r1), dtype=np.float32).reshape(r1 - r0, C)
        delta_rows.append(_block_fraction(d >= t_delta, r1 - r0, rsize, cstart, csizes))
    changed = s_delta > 0
    top_delta = s_delta >= t_delta
    pick = sample_index(name + "/scatter", idx.size, SCATTER)  # a seeded subset, not the first rows
    return {
        "k_percent": k_percent,
        "sample": int(idx.size),
        "numel": n,
        "sampled": bool(idx.size < n),
        "fisher_threshold": t_fisher,
        "delta_threshold": t_delta,
        "scatter": {"fisher": s_fisher[pick].tolist(), "delta": s_delta[pick].tolist(),
                    "row": (idx[pick] // C).tolist(), "column": (idx[pick] % C).tolist()},
        "roc": {"changed": {**roc_curve(s_fisher, changed), "auc": _nan_none(midrank_auc(s_fisher, changed)),
                            "positives": int(changed.sum())},
                "top_delta": {**roc_curve(s_fisher, top_delta), "auc": _nan_none(midrank_auc(s_fisher, top_delta)),
                              "positives": int(top_delta.sum())}},
        "changed_map": np.concatenate(changed_rows).tolist(),
        "fisher_topk_map": np.concatenate(fisher_rows).tolist(),
        "delta_topk_map": np.concatenate(delta_rows).tolist(),
    }


def _nan_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _block_fraction(mask: np.ndarray, nrows: int, rsize: int, cstart: np.ndarray, csizes: np.ndarray) -> np.ndarray:
    lr = np.arange(0, nrows, rsize)
    s = np.add.reduceat(np.add.reduceat(mask.view(np.uint8), lr, axis=0, dtype=np.int32), cstart, axis=1)
    rs = np.diff(np.append(lr, nrows))
    return s / (rs[:, None] * csizes[None, :])
