"""The drill-down and overlay numbers (app/explore/tensors.py, overlay.py) against brute force on
the whole tensor held in memory, with chunk sizes that split the tensor mid-way (the streamed
sums, maps, histogram and top coordinates must not depend on the chunking)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.explore import overlay, tensors


def _reader(x: np.ndarray):
    return lambda a, b: x[a:b]


def _brute_map(x: np.ndarray, pool: str) -> np.ndarray:
    R, C = x.shape
    br, bc = math.ceil(R / tensors.MAP_ROWS), math.ceil(C / tensors.MAP_COLS)
    out = np.zeros((math.ceil(R / br), math.ceil(C / bc)))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            out[i, j] = blk.max() if pool == "max" else blk.mean()
    return out


@pytest.mark.parametrize("shape,chunk", [((450, 130), 7 * 130), ((64, 64), 1 << 22), ((1, 77), 10), ((403, 401), 3000)])
@pytest.mark.parametrize("pool", ["max", "mean"])
def test_tensor_stats_equal_brute_force(shape, chunk, pool):
    rng = np.random.default_rng(1)
    x = (rng.lognormal(-8, 3, size=shape) * (rng.random(shape) > 0.2)).astype(np.float32)
    x.flat[5] = x.max() * 2  # a known largest value
    v = tensors.tensor_stats(shape, _reader(x.reshape(tensors.as_2d(shape))), pool=pool, chunk_elements=chunk)
    x2 = x.reshape(tensors.as_2d(shape))
    assert np.allclose(np.array(v["map"]["z"]), _brute_map(x2, pool), rtol=1e-6)
    assert v["sum"] == pytest.approx(float(x2.astype(np.float64).sum()), rel=1e-9)
    assert v["max"] == pytest.approx(float(x2.max()))
    assert v["histogram"]["zeros"] == int((x2 == 0).sum())
    # the histogram: every positive value in its 0.1-decade bin, edges[i] <= v < edges[i + 1]
    pos = x2[x2 > 0]
    edges = tensors.hist_edges()
    normal = edges > np.finfo(np.float32).tiny  # below it float32 rounds 10**e coarsely
    assert edges[0] > 0 and np.allclose(np.log10(edges[normal].astype(np.float64)),
                                        (tensors.HIST_LO + 0.1 * np.arange(edges.size))[normal], atol=0.004)
    lo, step = v["histogram"]["log10_lo"], v["histogram"]["step"]
    first = round((lo - tensors.HIST_LO) / step)
    want = [int(((pos >= edges[i]) & (pos < edges[i + 1])).sum()) for i in range(first, first + len(v["histogram"]["counts"]))]
    assert v["histogram"]["counts"] == want
    assert sum(v["histogram"]["counts"]) + v["histogram"]["zeros"] == x2.size
    # top coordinates: the largest values, ties by position, with their (row, column)
    order = np.lexsort((np.arange(x2.size), -x2.reshape(-1).astype(np.float64)))[: tensors.TOP_K]
    assert [(t["row"], t["column"]) for t in v["top"]] == [(int(i // x2.shape[1]), int(i % x2.shape[1])) for i in order]
    assert v["top"][0]["value"] == pytest.approx(float(x2.max()))
    # marginals: the sum of each output row / input column (pooled when more than MARGINAL_POINTS)
    rows = x2.astype(np.float64).sum(axis=1)
    assert np.allclose(v["row_marginal"]["mean_sum"], rows, rtol=1e-6)
    assert np.allclose(v["col_marginal"]["mean_sum"], x2.astype(np.float64).sum(axis=0), rtol=1e-6)
    assert v["row_marginal"]["top"][0] == {"index": int(np.argmax(rows)), "sum": pytest.approx(float(rows.max()))}


def test_marginals_are_pooled_as_block_means_for_long_axes():
    x = np.arange(5000 * 3, dtype=np.float32).reshape(5000, 3)
    v = tensors.tensor_stats(x.shape, _reader(x), chunk_elements=999)
    sums = x.astype(np.float64).sum(axis=1)
    size = math.ceil(5000 / tensors.MARGINAL_POINTS)
    assert v["row_marginal"]["blocks"][1] == [size, 2 * size - 1]
    assert v["row_marginal"]["mean_sum"][1] == pytest.approx(sums[size:2 * size].mean())


def test_heads_split_q_rows_and_o_columns():
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    h = tensors.heads_for("q", x.shape, cfg)
    v = tensors.tensor_stats(x.shape, _reader(x), heads=h)
    assert v["heads"]["sum"] == pytest.approx([float(x[i * 16:(i + 1) * 16].sum()) for i in range(4)])
    assert tensors.heads_for("k", (32, 64), cfg).n == 2
    o = tensors.heads_for("o", (8, 64), cfg)
    y = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    v = tensors.tensor_stats(y.shape, _reader(y), heads=o)
    assert v["heads"]["sum"] == pytest.approx([float(y[:, i * 16:(i + 1) * 16].sum()) for i in range(4)])
    assert tensors.heads_for("up", (32, 64), cfg) is None and tensors.heads_for("q", (30, 64), cfg) is None


def test_pool_is_checked():
    with pytest.raises(ValueError, match="pool: got 'sum'; accepted: max, mean"):
        tensors.tensor_stats((2, 2), _reader(np.zeros((2, 2), np.float32)), pool="sum")


def _brute_auc(score: np.ndarray, lab: np.ndarray) -> float:
    pos, neg = score[lab], score[~lab]
    gt = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(gt / (pos.size * neg.size))


def test_overlay_equals_brute_force_on_a_small_tensor():
    rng = np.random.default_rng(3)
    shape = (90, 70)
    f = rng.lognormal(-10, 2, size=shape).astype(np.float32)
    f[:5] = 0.0
    d = (np.abs(rng.normal(size=shape)) * (rng.random(shape) < 0.3 + 0.5 * (f > np.median(f)))).astype(np.float32)
    o = overlay.overlay_stats("t", shape, _reader(d), _reader(f), 5.0, chunk_elements=700)
    assert not o["sampled"] and o["sample"] == d.size  # small: every coordinate
    sc = o["scatter"]  # a seeded subset of the coordinates, from every part of the tensor
    assert len(sc["row"]) == overlay.SCATTER and max(sc["row"]) > 80 and min(sc["row"]) < 10
    assert all(d[r, c] == pytest.approx(v) for r, c, v in zip(sc["row"], sc["column"], sc["delta"], strict=True))
    fl, dl = f.reshape(-1), d.reshape(-1)
    assert o["roc"]["changed"]["auc"] == pytest.approx(_brute_auc(fl, dl > 0))
    k = math.ceil(d.size * 0.05)
    t_d = np.sort(dl)[::-1][k - 1]
    assert o["delta_threshold"] == pytest.approx(float(t_d))
    assert o["roc"]["top_delta"]["auc"] == pytest.approx(_brute_auc(fl, dl >= t_d))
    # the full ROC curve's area (trapezoids) is the AUC; the shown one is thinned from it
    full = overlay.roc_curve(fl, dl > 0, max_points=10**9)
    assert np.trapezoid(full["tpr"], full["fpr"]) == pytest.approx(o["roc"]["changed"]["auc"], abs=1e-12)
    shown = set(zip(o["roc"]["changed"]["fpr"], o["roc"]["changed"]["tpr"], strict=True))
    assert shown <= set(zip(full["fpr"], full["tpr"], strict=True)) and (1.0, 1.0) in shown
    # the maps are per-block fractions (blocks of one coordinate here: the masks themselves)
    assert np.array_equal(np.array(o["changed_map"]), (d > 0).astype(float))
    t_f = np.sort(fl)[::-1][k - 1]
    assert np.array_equal(np.array(o["fisher_topk_map"]), (f >= t_f).astype(float))
    assert np.array_equal(np.array(o["delta_topk_map"]), (d >= t_d).astype(float))


def test_overlay_samples_large_tensors_deterministically():
    n = overlay.SAMPLE * 2
    a = overlay.sample_index("x", n)
    assert a.size == overlay.SAMPLE and np.array_equal(a, overlay.sample_index("x", n))
    assert np.all(np.diff(a) > 0) and not np.array_equal(a, overlay.sample_index("y", n))
