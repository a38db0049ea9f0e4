"""compute.fisher.statistics against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from compute.fisher.statistics import (
    concentration_curve,
    gini,
    layer_module_stats,
    summary,
    tensor_stats,
    to_heatmaps,
    to_layer_stats,
    to_series,
    topk_jaccard,
)

F = {
    "model.embed_tokens.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),  # mass 2
    "model.layers.0.self_attn.q_proj.weight": torch.tensor([[4.0, 0.0], [0.0, 0.0]]),  # 4
    "model.layers.0.self_attn.q_norm.weight": torch.tensor([2.0, 0.0]),  # 2 (norm)
    "model.layers.1.self_attn.q_proj.weight": torch.tensor([[1.0, 1.0], [0.0, 0.0]]),  # 2
    "model.layers.1.input_layernorm.weight": torch.tensor([0.0, 0.0]),  # 0 (norm)
}  # total mass 10, 16 coordinates


def test_tensor_stats_by_hand():
    rows = {r["name"]: r for r in tensor_stats(F)}
    q0 = rows["model.layers.0.self_attn.q_proj.weight"]
    assert (q0["layer"], q0["module"], q0["numel"]) == (0, "q", 4)
    assert q0["mass"] == 4 and q0["mean"] == 1.0 and q0["max"] == 4 and q0["share"] == 0.4
    e = rows["model.embed_tokens.weight"]
    assert (e["layer"], e["module"], e["mean"], e["share"]) == (None, "embed", 0.5, 0.2)


def test_layer_module_stats_by_hand():
    g = {(r["layer"], r["module"]): r for r in layer_module_stats(F)}
    assert set(g) == {(None, "embed"), (0, "q"), (0, "norm"), (1, "q"), (1, "norm")}
    assert g[0, "norm"]["mass"] == 2 and g[0, "norm"]["mean"] == 1.0 and g[0, "norm"]["share"] == 0.2
    assert g[1, "q"]["mean"] == 0.5 and g[1, "q"]["max"] == 1.0
    order = [(r["layer"], r["module"]) for r in layer_module_stats(F)]
    assert order == [(0, "q"), (0, "norm"), (1, "q"), (1, "norm"), (None, "embed")]


def test_concentration_curve_by_hand():
    # sorted values: 4, 2, 1, 1, 1, 1, 0 x 10 ; total 10
    curve = dict(concentration_curve(F, (1 / 16, 2 / 16, 0.25, 0.5, 1.0, 1e-5)))
    assert curve[1 / 16] == pytest.approx(0.4)
    assert curve[2 / 16] == pytest.approx(0.6)
    assert curve[0.25] == pytest.approx(0.8)  # top 4: 4 + 2 + 1 + 1
    assert curve[0.5] == pytest.approx(1.0) and curve[1.0] == pytest.approx(1.0)
    assert curve[1e-5] == pytest.approx(0.4)  # at least one coordinate


def test_gini_by_hand():
    assert gini(torch.ones(5)) == pytest.approx(0.0)
    assert gini(torch.tensor([0.0, 0.0, 0.0, 1.0])) == pytest.approx(0.75)  # (n-1)/n
    # x = 1, 2, 3: 2*(1+4+9)/(3*6) - 4/3 = 28/18 - 24/18 = 2/9
    assert gini(torch.tensor([3.0, 1.0, 2.0])) == pytest.approx(2 / 9)
    assert gini(torch.zeros(3)) == 0.0


def test_topk_jaccard_by_hand():
    a = {"w": torch.tensor([5.0, 4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])}
    b = {"w": torch.tensor([5.0, 0.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])}
    # top 30% = 3 coords: {0,1,2} vs {0,2,3}: |∩|=2, |∪|=4
    assert topk_jaccard(a, b, 30.0) == pytest.approx(0.5)
    assert topk_jaccard(a, a, 30.0) == 1.0
    assert topk_jaccard(a, b, 10.0) == 1.0  # top 1 coordinate: index 0 in both
    with pytest.raises(ValueError, match="^topk_percent:"):
        topk_jaccard(a, b, 0.0)


class _Counted(dict):
    """A Fisher that counts the passes over its values (the chunks() protocol of HalfView)."""

    passes = 0

    def numel(self) -> int:
        return sum(v.numel() for v in self.values())

    def chunks(self, size: int):
        self.passes += 1
        for v in self.values():
            flat = v.reshape(-1)
            yield from (flat[o:o + size] for o in range(0, flat.numel(), size))


def _jaccard_by_sort(a: dict, b: dict, percent: float) -> float:
    """The sets by a stable sort of all values (ties at the k-th largest taken in order)."""
    va = torch.cat([v.reshape(-1) for v in a.values()])
    vb = torch.cat([v.reshape(-1) for v in b.values()])
    k = max(1, -(-va.numel() * percent // 100))
    k = min(int(k), va.numel())
    A = set(torch.sort(va, descending=True, stable=True).indices[:k].tolist())
    B = set(torch.sort(vb, descending=True, stable=True).indices[:k].tolist())
    return len(A & B) / len(A | B)


@pytest.mark.parametrize("path", ["two passes", "sampled bracket"])
@pytest.mark.parametrize("case", ["continuous", "correlated", "ties", "duplicates", "zeros", "signed"])
def test_topk_jaccard_in_two_passes_equals_the_sorted_sets(case, path, monkeypatch):
    """Two passes over each side (the cut bins resolved while the intersection is counted), or
    one where a sample brackets each k-th largest, give the Jaccard of the sets a full stable sort
    picks; where more values equal a k-th largest than the set takes (a few levels; or continuous
    values of which many appear twice, like two equal float32 values at the cut of a large
    Fisher), the sampled bracket takes the tied ones in flat order from the positions it kept, in
    its one pass, and the two-pass path builds the sets value by value (one more pass)."""
    from compute.fisher import statistics as st

    monkeypatch.setattr(st, "CHUNK", 1000)  # several chunks per tensor
    if path == "sampled bracket":  # these 5,077 values: a sample of a quarter of them
        monkeypatch.setattr(st, "JACCARD_SAMPLE_SHARE", 4)
        monkeypatch.setattr(st, "JACCARD_SAMPLE_MIN", 64)
    passes = 1 if path == "sampled bracket" else 2
    g = torch.Generator().manual_seed(7)
    shapes = [(40, 50), (3000,), (7, 11)]
    a = {f"t{i}": torch.rand(s, generator=g).pow(4) for i, s in enumerate(shapes)}
    if case == "continuous":
        b = {n: torch.rand(v.shape, generator=g).pow(4) for n, v in a.items()}
    elif case == "correlated":  # most coordinates of both cut bins the same: many pairs
        b = {n: v * (1 + 1e-3 * torch.rand(v.shape, generator=g)) for n, v in a.items()}
    elif case == "ties":  # a few levels: many values equal the k-th largest
        a = {n: (v * 5).floor() for n, v in a.items()}
        b = {n: (torch.rand(v.shape, generator=g) * 5).floor() for n, v in a.items()}
    elif case == "duplicates":  # continuous, every value twice (the copy at another position)
        a = {n: torch.cat([v.reshape(-1)[: v.numel() // 2]] * 2 + [v.reshape(-1)[:v.numel() % 2]]).reshape(v.shape)
             for n, v in a.items()}
        b = {n: v.flip(0) for n, v in a.items()}
    elif case == "signed":  # order keys with the sign fold, -0.0 among them (counted as 0.0)
        a = {n: torch.randn(v.shape, generator=g) for n, v in a.items()}
        b = {n: (v + 0.5 * torch.randn(v.shape, generator=g)) * (torch.rand(v.shape, generator=g) > 0.3)
             for n, v in a.items()}
        b = {n: torch.where(v == 0, -0.0 * torch.ones_like(v), v) for n, v in b.items()}
    else:  # mostly zeros, fewer non-zero values than k in one side
        a = {n: v * (torch.rand(v.shape, generator=g) < 0.004) for n, v in a.items()}
        b = {n: torch.rand(v.shape, generator=g) for n, v in a.items()}
    for pct in (0.1, 1.0, 10.0, 50.0):
        ca, cb = _Counted(a), _Counted(b)
        got = topk_jaccard(ca, cb, pct)
        assert got == pytest.approx(_jaccard_by_sort(a, b, pct), abs=1e-12)
        if case in ("continuous", "correlated") or (case == "signed" and pct < 50):  # 50%: ties at b's zeros
            assert (ca.passes, cb.passes) == (passes, passes)
    ca, cb = _Counted(a), _Counted(b)
    topk_jaccard(ca, cb, 1.0)
    if case in ("ties", "duplicates"):  # ties at the cut, taken in order: one more pass without a bracket
        assert ca.passes == (1 if path == "sampled bracket" else passes + 1)


def test_topk_jaccard_whose_sampled_bracket_misses_falls_back_to_two_passes(monkeypatch):
    """A bracket that does not hold the k-th largest (here: forced above every value but the
    sample's largest) is found out after its pass, and the two-pass path gives the exact sets."""
    from compute.fisher import statistics as st

    monkeypatch.setattr(st, "CHUNK", 1000)
    monkeypatch.setattr(st, "JACCARD_SAMPLE_SHARE", 4)
    monkeypatch.setattr(st, "JACCARD_SAMPLE_MIN", 64)
    monkeypatch.setattr(st, "_bracket", lambda keys, k, n: (int(keys.max()), st._INT32_MAX))
    g = torch.Generator().manual_seed(3)
    a = {"w": torch.rand(60, 70, generator=g), "b": torch.rand(900, generator=g)}
    b = {n: v + 0.3 * torch.rand(v.shape, generator=g) for n, v in a.items()}
    ca, cb = _Counted(a), _Counted(b)
    assert topk_jaccard(ca, cb, 5.0) == pytest.approx(_jaccard_by_sort(a, b, 5.0), abs=1e-12)
    assert (ca.passes, cb.passes) == (3, 3)


def test_a_sampled_bracket_holds_the_kth_largest_of_a_large_fisher():
    """At the sizes a job meets (here 2.4M values, the sample a 64th of them: the default share),
    the bracket holds each side's k-th largest: one pass, the sorted sets' Jaccard."""
    from compute.fisher import statistics as st

    g = torch.Generator().manual_seed(5)
    a = {"e": (torch.randn(1200, 1000, generator=g) * 2).exp(), "m": torch.rand(1_200_000, generator=g)}
    b = {n: v * (1 + 0.5 * torch.rand(v.shape, generator=g)) for n, v in a.items()}
    assert st.topk_jaccard_passes(2_400_000) == 1
    for pct in (0.01, 1.0, 30.0):
        ca, cb = _Counted(a), _Counted(b)
        assert topk_jaccard(ca, cb, pct) == pytest.approx(_jaccard_by_sort(a, b, pct), abs=1e-12)
        assert (ca.passes, cb.passes) == (1, 1)


def test_results_rows():
    stats = to_layer_stats(F)
    assert sum(s.group == "tensor" for s in stats) == 5
    agg = [s for s in stats if s.group == "layer_module"]
    assert sum(s.values["share"] for s in agg) == pytest.approx(1.0)
    mean_map, share_map = to_heatmaps(F)
    assert mean_map.y_labels == ["0", "1", "-"] and mean_map.x_labels == ["embed", "q", "norm"]
    assert mean_map.z[0] == [None, 1.0, 1.0] and mean_map.z[2] == [0.5, None, None]
    assert share_map.z[1] == [None, 0.2, 0.0]
    pts = to_series(F)
    assert pts[-1].step == 1.0 and pts[-1].value == pytest.approx(1.0)
    assert [p.value for p in pts] == sorted(p.value for p in pts)  # monotone
    s = summary(F)
    assert s["n_params"] == 16 and s["total_mass"] == 10 and s["max"] == 4


@pytest.mark.parametrize("kind", ["uniform", "signed", "ties", "tiny"])
def test_topk_threshold_streaming_select_equals_a_full_sort(kind: str) -> None:
    """The radix select (two histogram passes, no copy of all values: issue 30) gives the k-th
    largest value and the count above it exactly as a sort of the concatenation does, across
    tensors, with ties, negative values, -0.0 and values near the float32 subnormal range."""
    import numpy as np

    from compute.fisher.statistics import topk_threshold

    gen = torch.Generator().manual_seed(7)
    for trial in range(40):
        sizes = torch.randint(1, 4000, (1 + trial % 4,), generator=gen).tolist()
        d = {}
        for i, n in enumerate(sizes):
            v = {"uniform": lambda n: torch.rand(n, generator=gen),
                 "signed": lambda n: torch.randn(n, generator=gen),
                 "ties": lambda n: torch.randint(0, 4, (n,), generator=gen).float(),
                 "tiny": lambda n: torch.randn(n, generator=gen) * 1e-37}[kind](n)
            if kind == "signed":
                v[: n // 3] = -0.0
            d[f"t{i}"] = v.reshape(-1, 1) if i % 2 else v
        flat = np.concatenate([t.reshape(-1).numpy() for t in d.values()]) + 0.0
        for k in (1, int(torch.randint(1, flat.size + 1, (1,), generator=gen)), flat.size):
            want_t = float(np.sort(flat)[::-1][k - 1])
            assert topk_threshold(d, k) == (want_t, int((flat > want_t).sum())), (kind, trial, k)


def _exact_gini(x: torch.Tensor) -> float:
    x = x.double().sort().values
    n, s = len(x), float(x.sum())
    return float(2 * (torch.arange(1, n + 1, dtype=torch.float64) * x).sum() / (n * s) - (n + 1) / n)


@pytest.mark.parametrize("make", [
    lambda g: torch.rand(200_000, generator=g) ** 6,                       # heavy tail
    lambda g: (torch.randn(100_000, generator=g) * 3).exp() * 1e-9,        # many decades, tiny values
    lambda g: torch.randint(0, 4, (50_000,), generator=g).float(),         # ties and zeros
    lambda g: torch.cat([torch.zeros(10_000), torch.rand(3, generator=g)]),
])
def test_streaming_gini_brackets_the_exact_one_and_the_curve_is_exact(make):
    """Issue 30: the Gini and the concentration curve come from a streaming histogram (no sorted
    copy of the values): the Gini's bracket holds the exact value and is tight; every share of
    the concentration curve equals the one from a full sort."""
    import math

    from compute.fisher.statistics import ValueHistogram, gini_error

    x = make(torch.Generator().manual_seed(0))
    parts = {"a": x[: len(x) // 3].reshape(-1, 1), "b": x[len(x) // 3:]}
    h = ValueHistogram.of(parts)
    lo, hi = h.gini_bounds()
    exact = _exact_gini(x)
    assert lo - 1e-12 <= exact <= hi + 1e-12
    assert hi - lo < 1e-4
    assert abs(gini(parts) - exact) <= gini_error(h) + 1e-12
    desc = x.double().sort(descending=True).values
    for frac, share in concentration_curve(parts):
        k = min(len(x), max(1, math.ceil(frac * len(x) - 1e-9)))
        assert share == pytest.approx(float(desc[:k].sum() / desc.sum()), rel=1e-12, abs=1e-15)
