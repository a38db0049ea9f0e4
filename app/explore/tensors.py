"""The numbers of one tensor, streamed in row chunks: a pooled 2-D map, marginals per output row,
per input column and per attention head, a histogram of log10 values and the top coordinates.

Pure numpy (the web process never imports torch). A tensor of shape (R, C) is read in chunks of
whole rows (`read(start, stop) -> float32 array (stop - start, C)`), so a 262k x 640 embedding
never needs more than one chunk in memory beyond the small outputs. A 1-D tensor is one row; a
tensor of more dimensions is (shape[0], the rest flattened).

Definitions (the tests recompute each by brute force):
- map: the (R, C) values pooled into at most MAP_ROWS x MAP_COLS blocks of ceil(R / MAP_ROWS) rows
  by ceil(C / MAP_COLS) columns (the last block may be smaller); each block holds the block
  maximum ("max" pooling: a large value anywhere in the block shows) or the block mean ("mean":
  for a mask, the kept fraction of the block).
- row / column marginals: the sum of the values of each output row / input column, in float64;
  with more than MARGINAL_POINTS rows they are shown pooled as the mean row sum of each block.
- heads: the sum over the rows (q, k, v: output features) or columns (o: input features) of
  each attention head, when the model's config gives the head count and the axis divides evenly.
- histogram: counts of positive values in bins HIST_STEP decades wide on a fixed grid (so chunks
  add up): bin i holds edges[i] <= v < edges[i + 1], edges = 10**(HIST_LO + i HIST_STEP) truncated
  to bfloat16 (`hist_edges`; the first bin also holds smaller values, the last larger ones),
  trimmed to the bins that hold values; zeros and negatives counted apart.
- top: the TOP_K largest values with their (row, column), ties by position (row-major).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

MAP_ROWS = 200
MAP_COLS = 200
MARGINAL_POINTS = 2_000
HIST_STEP = 0.1  # decades per histogram bin
HIST_LO, HIST_HI = -40.0, 38.5  # float32 spans 1.4e-45 .. 3.4e38: the first bin holds what lies below, the last above
TOP_K = 25
CHUNK_ELEMENTS = 1 << 22  # 4M float32 = 16 MB read at a time

Reader = Callable[[int, int], np.ndarray]


@dataclass(frozen=True)
class Heads:
    """How the rows (or columns) of a tensor split into attention heads."""

    n: int  # heads on the split axis (query heads, or key-value heads for k / v)
    axis: str  # "rows" or "columns"
    what: str  # "query heads", "key-value heads"


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, columns) a tensor of `shape` is viewed as."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), int(math.prod(shape[1:]))


def blocks(n: int, max_blocks: int) -> np.ndarray:
    """Start offsets of ceil(n / max_blocks)-sized blocks covering range(n)."""
    size = max(1, math.ceil(n / max_blocks))
    return np.arange(0, n, size, dtype=np.int64)


def _edges(starts: np.ndarray, n: int) -> list[list[int]]:
    """[[first, last], ...] of each block (inclusive), for labels and hover."""
    ends = [*starts[1:].tolist(), n]
    return [[int(a), int(b) - 1] for a, b in zip(starts.tolist(), ends, strict=True)]


def hist_edges() -> np.ndarray:
    """The fixed histogram grid: 10**(HIST_LO + i * HIST_STEP) truncated to bfloat16 (8
    significant bits, so a bin is 0.1 decade wide to within 0.4%), as float32."""
    n = int(round((HIST_HI - HIST_LO) / HIST_STEP))
    with np.errstate(over="ignore", under="ignore"):
        e = (10.0 ** (HIST_LO + HIST_STEP * np.arange(n + 1))).astype(np.float32)
    return (e.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _fine_to_coarse(edges: np.ndarray) -> np.ndarray:
    """For each positive bfloat16 bit pattern 1..32767: the histogram bin its values fall in
    (the first bin also holds what lies below edges[1], the last what lies above its edge)."""
    values = (np.arange(1, 1 << 15, dtype=np.uint32) << 16).view(np.float32)
    return np.clip(np.searchsorted(edges, values, side="right") - 1, 0, edges.size - 2)


def head_sums(values: np.ndarray, heads: Heads | None) -> list[float] | None:
    """Per-head sums of a marginal (row sums for heads on rows, column sums for columns)."""
    if heads is None or heads.n <= 1 or len(values) % heads.n:
        return None
    return [float(x) for x in values.reshape(heads.n, -1).sum(axis=1)]


def tensor_stats(shape: tuple[int, ...], read: Reader, pool: str = "max", heads: Heads | None = None,
                 top_k: int = TOP_K, chunk_elements: int = CHUNK_ELEMENTS) -> dict[str, Any]:
    """Everything the tensor view shows, as plain JSON (see the module docstring)."""
    if pool not in ("max", "mean"):
        raise ValueError(f"pool: got {pool!r}; accepted: max, mean")
    R, C = as_2d(shape)
    rstart, cstart = blocks(R, MAP_ROWS), blocks(C, MAP_COLS)
    rsize = int(rstart[1] - rstart[0]) if len(rstart) > 1 else R
    # whole row blocks per chunk, so each pooled map row is computed from one chunk
    per_chunk = max(1, (chunk_elements // max(C, 1)) // rsize) * rsize
    csizes = np.diff(np.append(cstart, C))
    edges = hist_edges()
    nbins = edges.size - 1
    coarse = _fine_to_coarse(edges)
    hist = np.zeros(nbins, dtype=np.int64)
    row_sum = np.zeros(R, dtype=np.float64)
    col_sum = np.zeros(C, dtype=np.float64)
    pooled: list[np.ndarray] = []
    top_v = np.empty(0, dtype=np.float32)
    top_i = np.empty(0, dtype=np.int64)
    n_zero = n_neg = n_nan = 0
    vmax = -math.inf
    for r0 in range(0, R, per_chunk):
        r1 = min(R, r0 + per_chunk)
        x = np.asarray(read(r0, r1), dtype=np.float32).reshape(r1 - r0, C)
        sums = x.sum(axis=1, dtype=np.float64)
        if not np.isfinite(sums).all():  # a NaN or inf somewhere: counted, then read as 0
            bad = ~np.isfinite(x)
            n_nan += int(bad.sum())
            x = np.where(bad, np.float32(0), x)
            sums = x.sum(axis=1, dtype=np.float64)
        row_sum[r0:r1] = sums
        col_sum += x.sum(axis=0, dtype=np.float64)
        vmax = max(vmax, float(x.max()))
        flat = x.reshape(-1)
        # histogram: the top 16 bits of a float32 are its bfloat16 truncation, monotone in the
        # value for positive floats; the edges are bfloat16 values, so each of the 32767
        # positive bfloat16 bins lies inside one histogram bin (exact, one shift + one bincount)
        fine = np.bincount(flat.view(np.uint32) >> 16, minlength=1 << 16)
        n_zero_here = int(np.count_nonzero(flat == 0))
        n_pos = int(np.count_nonzero(flat > 0))
        n_zero += n_zero_here
        n_neg += flat.size - n_pos - n_zero_here
        pos_fine = fine[1:1 << 15]
        hist += np.bincount(coarse, weights=pos_fine, minlength=nbins).astype(np.int64)
        hist[0] += n_pos - int(pos_fine.sum())  # positive denormals below 2**-133: the first bin
        # pooled map rows of this chunk
        lr = np.arange(0, r1 - r0, rsize)
        if pool == "max":
            m = np.maximum.reduceat(np.maximum.reduceat(x, lr, axis=0), cstart, axis=1)
        else:
            sm = np.add.reduceat(np.add.reduceat(x.astype(np.float64), lr, axis=0), cstart, axis=1)
            rs = np.diff(np.append(lr, r1 - r0))
            m = sm / (rs[:, None] * csizes[None, :])
        pooled.append(m.astype(np.float64))
        # top coordinates: the chunk's values at or above the k-th best so far, merged with the
        # best so far (ties by position)
        if top_v.size >= top_k:
            cand = np.flatnonzero(flat >= top_v[-1])
        else:
            k = min(top_k, flat.size)
            cand = np.argpartition(-flat, k - 1)[:k] if k < flat.size else np.arange(flat.size)
        top_v = np.concatenate([top_v, flat[cand]])
        top_i = np.concatenate([top_i, cand.astype(np.int64) + r0 * C])
        order = np.lexsort((top_i, -top_v.astype(np.float64)))[:top_k]
        top_v, top_i = top_v[order], top_i[order]
    total = float(row_sum.sum())
    grid = np.concatenate(pooled, axis=0) if pooled else np.zeros((0, 0))
    nz = np.nonzero(hist)[0]
    lo, hi = (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
    rows_pooled = blocks(R, MARGINAL_POINTS)
    rsz = np.diff(np.append(rows_pooled, R))
    cols_pooled = blocks(C, MARGINAL_POINTS)
    csz = np.diff(np.append(cols_pooled, C))
    n = R * C
    return {
        "shape": [int(s) for s in shape],
        "rows": R,
        "columns": C,
        "numel": n,
        "pool": pool,
        "map": {"z": grid.tolist(), "row_blocks": _edges(rstart, R), "col_blocks": _edges(cstart, C)},
        "row_marginal": {"blocks": _edges(rows_pooled, R),
                         "mean_sum": (np.add.reduceat(row_sum, rows_pooled) / rsz).tolist() if R else [],
                         "top": _top_of(row_sum)},
        "col_marginal": {"blocks": _edges(cols_pooled, C),
                         "mean_sum": (np.add.reduceat(col_sum, cols_pooled) / csz).tolist() if C else [],
                         "top": _top_of(col_sum)},
        "heads": _heads(row_sum, col_sum, heads),
        "histogram": {"log10_lo": round(HIST_LO + lo * HIST_STEP, 6), "step": HIST_STEP,
                      "counts": hist[lo:hi].tolist(), "zeros": n_zero, "negative": n_neg,
                      "non_finite": n_nan},
        "sum": total,
        "mean": total / n if n else 0.0,
        "max": vmax if n else 0.0,
        "top": [{"row": int(i // C), "column": int(i % C), "value": float(v)}
                for v, i in zip(top_v.tolist(), top_i.tolist(), strict=True)],
    }


def _top_of(sums: np.ndarray, k: int = 10) -> list[dict[str, float]]:
    """The k largest marginal sums with their index."""
    if not sums.size:
        return []
    k = min(k, sums.size)
    idx = np.argsort(-sums, kind="stable")[:k]
    return [{"index": int(i), "sum": float(sums[i])} for i in idx]


def _heads(row_sum: np.ndarray, col_sum: np.ndarray, heads: Heads | None) -> dict[str, Any] | None:
    if heads is None:
        return None
    sums = head_sums(row_sum if heads.axis == "rows" else col_sum, heads)
    return None if sums is None else {"what": heads.what, "axis": heads.axis, "sum": sums}


def heads_for(module: str, shape: tuple[int, ...], config: dict[str, Any] | None) -> Heads | None:
    """The head split of a q / k / v / o weight from an HF config (num_attention_heads,
    num_key_value_heads); None for other tensors or when the shape does not divide."""
    if not config or len(shape) != 2 or module not in ("q", "k", "v", "o"):
        return None
    n_q = config.get("num_attention_heads") or config.get("n_head")
    if not isinstance(n_q, int) or n_q <= 0:
        return None
    n_kv = config.get("num_key_value_heads") or n_q
    if module == "o":
        return Heads(n_q, "columns", "query heads") if shape[1] % n_q == 0 else None
    n = n_q if module == "q" else int(n_kv)
    return Heads(n, "rows", "query heads" if module == "q" else "key-value heads") if shape[0] % n == 0 else None
