"""The per-coordinate Cauchy-Schwarz bound |mean A s| <= sqrt(mean A^2) sqrt(mean s^2)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from compute.studies.bound import (
    accumulate_sample_grads,
    bound_from_sample_grads,
    holds,
    pearson,
    spearman,
    summarize,
)
from tests.unit.fisher_tiny import tiny_model


def test_bound_holds_on_random_tensors_and_is_tight_when_a_matches_the_score() -> None:
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(16, 500, generator=g) * torch.rand(500, generator=g)
    adv = torch.randn(16, generator=g)
    lhs, rhs, fisher = bound_from_sample_grads(grads, adv)
    assert bool(holds(lhs, rhs).all())
    assert_close(fisher, (grads.double() ** 2).mean(0))
    # equality case: A proportional to the score of coordinate 7
    lhs, rhs, _ = bound_from_sample_grads(grads, -3.0 * grads[:, 7])
    assert_close(lhs[7], rhs[7], rtol=1e-12, atol=0)
    assert float((lhs / rhs).max()) == pytest.approx(1.0, abs=1e-12)


def test_check_catches_a_mismatched_sample_set() -> None:
    """If the LHS and the RHS use different samples the inequality is not guaranteed: the
    fraction must then drop below 1, which shows the check can fail."""
    g = torch.Generator().manual_seed(1)
    a_grads = torch.randn(8, 2000, generator=g)
    b_grads = 0.3 * torch.randn(8, 2000, generator=g)  # another, smaller-score sample set
    adv = torch.randn(8, generator=g)
    lhs, _, _ = bound_from_sample_grads(a_grads, adv)
    _, rhs_b, _ = bound_from_sample_grads(b_grads, adv)
    assert float(holds(lhs, rhs_b).double().mean()) < 0.9


def test_per_sample_grads_match_brute_force_and_bound_holds_on_tiny_model() -> None:
    model = tiny_model("qwen3")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 16, (5, 7), generator=gen)
    am = torch.ones_like(ids)
    am[1, 5:] = 0  # one right-padded row
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[:, 3:] = True
    cm &= am.bool()
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0, -1.5])
    res = accumulate_sample_grads(model, ids, am, cm, adv)
    # brute force: full score vectors stacked, via the model's own loss on each row
    rows = []
    for i in range(5):
        model.zero_grad()
        w = int(am[i].sum())
        logits = model(input_ids=ids[i : i + 1, :w]).logits[0, :-1]  # (w-1, V)
        lp = logits.log_softmax(-1).gather(-1, ids[i, 1:w, None]).squeeze(-1)
        (lp * cm[i, 1:w]).sum().backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    lhs, rhs, fisher = bound_from_sample_grads(torch.stack(rows), adv)
    names = [n for n, _ in model.named_parameters()]
    # float32 through two paths (the chunked head's fused log-prob, log_softmax) that round
    # differently: elementwise, a small coordinate differed by 1.5e-4 relative on one CPU (its
    # MKL), so the comparison is of the whole vector (relative L1) and of each coordinate against
    # the vector's scale; a wrong per-sample gradient is off by O(1) in both
    for got, want in ((torch.cat([res.lhs[n].flatten() for n in names]), lhs),
                      (torch.cat([res.fisher[n].flatten() for n in names]), fisher)):
        got, want = got.double(), want.double()
        assert float((got - want).abs().sum() / want.abs().sum()) < 1e-5
        assert_close(got, want, rtol=1e-3, atol=1e-6 * float(want.abs().max()))
    summary, series, heatmaps = summarize(res)
    # same samples: the identity, a self-check that cannot fail, and no independent check made
    assert summary["identity_fraction_holds"] == 1.0 and summary["identity_violations"] == 0
    assert summary["identity_max_ratio"] <= 1 + 1e-5
    assert summary["bound_independent"] is False and "bound_fraction_holds" not in summary
    assert summary["grad_sqrt_fisher_same_spearman"] > 0.3  # small Fisher means small gradient
    assert summary["bound_tokens"] == int(cm[:, 1:].sum()) and summary["bound_samples"] == 5
    assert len(series) == 2 * min(3000, summary["bound_coordinates"])
    assert heatmaps and heatmaps[0].meta["x"] == "log10 sqrt(F_i)"


def test_rank_correlations() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x**3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert pearson(x, 2 * x + 1) == pytest.approx(1.0)
    # ties share their mean rank: ranks of (1, 1, 2) are (0.5, 0.5, 2)
    assert spearman(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.0, 0.0, 5.0])) == pytest.approx(1.0)


def test_independent_fisher_check_reports_a_constructed_violation() -> None:
    """With a Fisher from other samples the check can fail: coordinates whose independent Fisher is
    too small for their gradient are counted, with the ratio distribution."""
    from compute.studies.bound import BoundResult, ratio_stats

    lhs = {"w": torch.tensor([0.5, 0.2, 0.0, 0.3], dtype=torch.float64)}
    same_f = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)}
    rms_a = 1.0
    res = BoundResult(lhs=lhs, rhs={"w": rms_a * same_f["w"].sqrt()}, fisher=same_f, n_samples=4,
                      rms_advantage=rms_a, n_tokens=16)
    # independent Fisher: coordinate 0 far too small (violation: 0.5 > sqrt(0.01) = 0.1), coordinate 3
    # zero with a non-zero gradient (violation with an infinite ratio), 1 and 2 hold
    indep = {"w": torch.tensor([0.01, 1.0, 4.0, 0.0])}
    summary, series, heat = summarize(res, fisher=indep, fisher_info={"source": "test"})
    assert summary["bound_independent"] and summary["bound_fisher"] == {"source": "test"}
    assert summary["bound_violations"] == 2 and summary["bound_zero_fisher_violations"] == 1
    assert summary["bound_violation_fraction"] == pytest.approx(0.5)
    assert summary["bound_fraction_holds"] == pytest.approx(0.5)
    # ratios over coordinates with F > 0: 0.5/0.1 = 5, 0.2/1 = 0.2, 0/2 = 0
    assert summary["bound_max_ratio"] == pytest.approx(5.0)
    assert summary["bound_median_ratio"] == pytest.approx(0.2)  # lower median of {0, 0.2, 5}
    assert summary["bound_n_over_t"] == pytest.approx(4 / 16)
    assert sum(summary["bound_ratio_histogram"]["counts"]) == 3
    assert summary["identity_fraction_holds"] == 1.0  # the identity still holds on the same samples
    # the scatter is against the independent sqrt(F)
    xs = sorted(p.step for p in series if p.name == "bound/|grad|")
    assert xs == pytest.approx([0.0, 0.1, 1.0, 2.0])
    st = ratio_stats(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0 - 1e-9]))
    assert st["violations"] == 0  # within the float allowance


def test_independent_fisher_from_many_samples_nearly_always_bounds() -> None:
    """The bound is about expectations: with the gradient's samples and the Fisher's drawn from the
    same distribution and many of each, violations are rare, and the ratio median is well below 1."""
    from compute.studies.bound import BoundResult

    g = torch.Generator().manual_seed(3)
    scale = torch.rand(400, generator=g) + 0.1
    s_grad = torch.randn(64, 400, generator=g) * scale
    adv = torch.randn(64, generator=g)
    lhs, rhs, f_same = bound_from_sample_grads(s_grad, adv)
    s_ind = torch.randn(4096, 400, generator=g) * scale
    f_ind = {"w": (s_ind.double() ** 2).mean(0)}
    res = BoundResult({"w": lhs}, {"w": rhs}, {"w": f_same}, 64, float(adv.double().pow(2).mean().sqrt()),
                      n_tokens=640)
    summary, _, _ = summarize(res, fisher=f_ind)
    assert summary["bound_violations"] <= 4
    assert summary["bound_median_ratio"] < 0.5
    # a Fisher estimated on much smaller scores violates on most coordinates
    summary, _, _ = summarize(res, fisher={"w": f_ind["w"] * 1e-4})
    assert summary["bound_violation_fraction"] > 0.5


def test_summarize_refuses_a_fisher_missing_a_parameter() -> None:
    from compute.studies.bound import BoundResult

    t = torch.ones(3, dtype=torch.float64)
    res = BoundResult({"a": t, "b": t}, {"a": t, "b": t}, {"a": t, "b": t}, 2, 1.0, n_tokens=4)
    with pytest.raises(ValueError, match="^fisher:"):
        summarize(res, fisher={"a": torch.ones(3)})


def test_the_streamed_summary_equals_the_whole_vector_statistics(monkeypatch) -> None:
    """Issue 30: summarize counts everything over slices (the ratios' quantiles by an exact radix
    select) instead of flattening every coordinate in float64 and sorting (~120 bytes/param). With
    slices of 7 coordinates and the select made to go bit by bit, every number equals the one
    computed on the whole flattened vectors: violations, fractions, the lower quantiles of a
    stable sort, the histogram, the rank correlations (all coordinates sampled), the log grid."""
    from compute.studies import bound as B

    g = torch.Generator().manual_seed(5)
    shapes = {"a": (9, 4), "b": (23,), "c": (5, 5)}
    sum_ag = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    sum_g2 = {n: sum_ag[n] ** 2 * (1 + torch.rand(s, generator=g, dtype=torch.float64)) for n, s in shapes.items()}
    sum_g2["b"][:6] = 0.0  # zero same-sample Fisher: no ratio there
    sum_ag["b"][:3] = 0.0
    res = B.BoundResult(*(B._Terms(sum_ag, sum_g2, 3.0, 4, k) for k in range(3)), n_samples=4,
                        rms_advantage=math.sqrt(3.0 / 4), n_tokens=20)
    indep = {n: (torch.rand(s, generator=g) * 2).round(decimals=1) for n, s in shapes.items()}  # ties, zeros
    flat = {k: torch.cat([getattr(res, k)[n].flatten() for n in shapes]) for k in ("lhs", "rhs", "fisher")}
    whole, _, whole_heat = B.summarize(res, fisher=indep)  # one slice (SLICE is a million)
    monkeypatch.setattr(B, "SLICE", 7)
    monkeypatch.setattr(B, "SELECT_SORT_MAX", 2)
    got, series, heat = B.summarize(res, fisher=indep)
    sqf = torch.cat([indep[n].flatten() for n in shapes]).double().sqrt()
    rhs = res.rms_advantage * sqf
    live = rhs > 0
    ratio = torch.sort(flat["lhs"][live] / rhs[live], stable=True).values
    m = ratio.numel()
    for q in B.RATIO_QUANTILES:
        assert got["bound_ratio_quantiles"][f"p{q * 100:g}"] == float(ratio[min(m - 1, math.ceil(q * m) - 1)])
    ok = B.holds(flat["lhs"], rhs, 1e-5, 1e-12)
    assert got["bound_violations"] == int((~ok).sum()) and got["bound_coordinates"] == flat["lhs"].numel()
    assert got["bound_zero_fisher_violations"] == int(((~live) & (flat["lhs"] > 1e-12)).sum())
    assert got["bound_max_ratio"] == float(ratio.max())
    assert got["bound_mean_ratio"] == pytest.approx(float(ratio.mean()), rel=1e-12)
    assert got["bound_ratio_histogram"] == whole["bound_ratio_histogram"]
    assert sum(got["bound_ratio_histogram"]["counts"]) == m
    assert got["grad_sqrt_fisher_spearman"] == pytest.approx(spearman(flat["lhs"], sqf), abs=1e-12)
    assert got["grad_sqrt_fisher_same_spearman"] == pytest.approx(spearman(flat["lhs"], flat["fisher"].sqrt()), abs=1e-12)
    assert got["grad_sqrt_fisher_pearson"] == pytest.approx(pearson(flat["lhs"], sqf), abs=1e-12)
    same_ok = B.holds(flat["lhs"], flat["rhs"], 1e-5, 1e-12)  # 3 made to fail: F = 0, g != 0
    assert got["identity_violations"] == int((~same_ok).sum()) == 3
    for k, v in whole.items():
        assert got[k] == pytest.approx(v, rel=1e-12) if isinstance(v, float) else got[k] == v, k
    assert heat[0].z == whole_heat[0].z and heat[0].x_labels == whole_heat[0].x_labels
    assert len(series) == 2 * flat["lhs"].numel()  # under max_points: every coordinate, by sqrt F
    xs = [p.step for p in series if p.name == "bound/|grad|"]
    assert xs == sorted(xs) and sorted(xs) == sorted(sqf.tolist())


def test_order_statistics_by_radix_select_match_a_sort(monkeypatch) -> None:
    from compute.studies import bound as B

    g = torch.Generator().manual_seed(1)
    vals = torch.cat([torch.rand(500, generator=g, dtype=torch.float64) ** 3, torch.full((300,), 0.25, dtype=torch.float64),
                      torch.zeros(50, dtype=torch.float64), torch.tensor([math.inf])])
    vals = vals[torch.randperm(vals.numel(), generator=g)]
    ranks = [0, 1, 400, 425, 600, 849, 850]
    want = torch.sort(vals).values
    for limit in (1 << 20, 2):  # sorted in one pass; bit by bit, 300 equal values in the last bin
        monkeypatch.setattr(B, "SELECT_SORT_MAX", limit)
        got = B._order_stats(lambda: iter(vals.split(37)), ranks)
        assert got == {r: float(want[r]) for r in ranks}


def test_the_summary_samples_coordinates_uniformly_without_replacement() -> None:
    """The correlations and the scatter read uniform samples of coordinates drawn slice by slice
    (_Sample): exactly `size` distinct positions when there are more, all of them otherwise, the
    same for the same seed, and no slice favoured (each slice's share within 4 sigma of even)."""
    from compute.studies.bound import _Sample

    def draw(size: int, total: int, slice_: int, seed: int = 0) -> torch.Tensor:
        s = _Sample(size, torch.Generator().manual_seed(seed))
        for o in range(0, total, slice_):
            s.add(o, min(slice_, total - o))
        return s.indices()

    got = draw(2000, 100_000, 1000)
    assert got.numel() == 2000 and torch.equal(got, torch.unique(got)) and int(got.max()) < 100_000
    assert torch.equal(got, draw(2000, 100_000, 1000)) and not torch.equal(got, draw(2000, 100_000, 1000, seed=1))
    per_slice = torch.bincount(got // 10_000, minlength=10).double()  # 10 slices of 10 ranges
    assert float((per_slice - 200).abs().max()) < 4 * math.sqrt(200 * 0.9)
    assert torch.equal(draw(5000, 1234, 100), torch.arange(1234))  # fewer coordinates than the sample


def test_the_check_in_groups_of_parameters_equals_the_whole_check(monkeypatch) -> None:
    """Issue 30: at 8B the check's float64 sums (16 bytes/param, 128 GB) fit no device, so
    bound_check folds them a group of parameters at a time (the others frozen for the backward),
    summarises each group and drops it. Every number equals the one-group check's: the counts,
    the ratio's extremes and histogram, the sampled correlations and scatter, the grid; the ratio's
    quantiles, exact in one group, are bracketed in several and must lie within their stated
    relative error of the exact ones. The sums of a group equal the whole backward's."""
    from compute.lm.verifiable_tasks import get_task
    from compute.studies import bound as B
    from tests.unit.fisher_tiny import ParityTask, char_tokenizer


    tok, task = char_tokenizer(), ParityTask(get_task("arithmetic-add?digits=1"))
    model = tiny_model("llama")
    order = [n for n, _ in model.named_parameters()]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    indep = {n: torch.rand(p.shape, generator=g) * 1e-3 for n, p in model.named_parameters()}
    kw = dict(fisher=indep, fisher_info={"source": "test"}, prompts=3, group=4, max_new_tokens=5, seed=1)
    monkeypatch.setattr(B, "SLICE", 8)  # slices of 8 coordinates: a parameter can be cut at a multiple of 8
    whole, w_series, w_heat = B.bound_check(model, tok, task, **kw)
    size = dict((n, p.numel()) for n, p in model.named_parameters())
    first = order[0]
    cut = 8 * (size[first] // 16)  # the first parameter (the embedding) in two groups
    groups = [[(first, 0, cut)], [(first, cut, size[first])] + [(n, 0, size[n]) for n in order[1:4]],
              [(n, 0, size[n]) for n in order[4:]]]
    parts, p_series, p_heat = B.bound_check(model, tok, task, groups=groups, **kw)
    assert whole["bound_groups"] == 1 and parts["bound_groups"] == 3
    assert whole["bound_ratio_quantiles_exact"] and not parts["bound_ratio_quantiles_exact"]
    err = parts["bound_ratio_quantile_rel_error"]
    assert 0 < err <= 2.0 ** -(B.FINE_MANTISSA_BITS + 1)
    for q, exact in whole["bound_ratio_quantiles"].items():
        assert abs(parts["bound_ratio_quantiles"][q] - exact) <= err * exact * (1 + 1e-9), q
    assert whole["bound_violations"] > 0  # a Fisher of the wrong scale: the counts are not all trivial
    skip = {"bound_groups", "bound_group_largest_coordinates", "bound_ratio_quantiles", "bound_median_ratio",
            "bound_ratio_quantiles_exact", "bound_ratio_quantile_rel_error"}
    for k, v in whole.items():
        if k not in skip:
            assert parts[k] == (pytest.approx(v, rel=1e-9) if isinstance(v, float) else v), k
    assert [p.name for p in p_series] == [p.name for p in w_series]
    for attr in ("step", "value"):
        assert [getattr(p, attr) for p in p_series] == pytest.approx([getattr(p, attr) for p in w_series], rel=1e-9)
    assert p_heat[0].z == w_heat[0].z and p_heat[0].x_labels == w_heat[0].x_labels
    # one group's sums are the whole backward's, and the model is left as it was
    roll, adv, _ = B._first_batch(model, tok, task, 3, 4, 5, 1, True, 1.0)
    full = B.accumulate_sample_grads(model, roll.input_ids, roll.attention_mask, roll.completion_mask, adv)
    one = B.accumulate_sample_grads(model, roll.input_ids, roll.attention_mask, roll.completion_mask, adv,
                                    pieces=groups[1])
    assert list(one.lhs) == [n for n, _, _ in groups[1]] and one.ranges == {first: (cut, size[first])}
    for n, lo, hi in groups[1]:
        assert_close(one.lhs[n].reshape(-1), full.lhs[n].reshape(-1)[lo:hi], rtol=1e-12, atol=0)
        assert_close(one.fisher[n].reshape(-1), full.fisher[n].reshape(-1)[lo:hi], rtol=1e-12, atol=0)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    for bad in ([groups[1], groups[0], groups[2]],  # out of order
                [groups[0], groups[2]],  # coordinates left out
                [[(first, 0, cut + 3)], [(first, cut + 3, size[first])] + groups[1][1:], groups[2]]):  # cut off a slice
        with pytest.raises(ValueError, match="^groups:"):
            B.bound_check(model, tok, task, groups=bad, **kw)
    with pytest.raises(ValueError, match="^pieces:"):
        B.accumulate_sample_grads(model, roll.input_ids, roll.attention_mask, roll.completion_mask, adv,
                                  pieces=[("nope", 0, 1)])


def test_the_ratio_histogram_counts_each_ratio_in_its_bin_edges_included() -> None:
    """The coarse histogram is counted from the ratios at or above each edge: the same bins as
    torch.bucketize(right=True) (a ratio on an edge in the bin it opens; infinity and a NaN in the
    last), and the fine histogram's bracket holds every exact quantile."""
    from compute.studies import bound as B

    edges = torch.tensor(B.RATIO_EDGES[1:-1], dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    r = torch.cat([torch.rand(5000, generator=g, dtype=torch.float64) * 6, torch.rand(5000, generator=g, dtype=torch.float64) * 1e-2,
                   torch.tensor(B.RATIO_EDGES[1:-1] + [0.0, math.inf, math.nan], dtype=torch.float64)])
    st = B._RatioStats(1e-5, 1e-12)
    st.add(r, torch.ones_like(r))
    assert torch.equal(st.hist, torch.bincount(torch.bucketize(r, edges, right=True), minlength=len(B.RATIO_EDGES) - 1))
    st = B._RatioStats(1e-5, 1e-12)
    finite = r[r.isfinite()]
    st.add(finite, torch.ones_like(finite))
    got, exact = st.result(), st.result(lambda: iter([(finite, torch.ones_like(finite))]))
    assert not got["ratio_quantiles_exact"] and exact["ratio_quantiles_exact"]
    for q, v in exact["ratio_quantiles"].items():
        assert abs(got["ratio_quantiles"][q] - v) <= got["ratio_quantile_rel_error"] * v * (1 + 1e-9), q
    # most gradients zero (embedding rows no token of the batch uses): the median is exactly 0
    z = torch.cat([torch.zeros(12000, dtype=torch.float64), finite])
    st = B._RatioStats(1e-5, 1e-12)
    st.add(z, torch.ones_like(z))
    got = st.result()
    assert got["ratio_quantiles"]["p50"] == 0.0 and got["ratio_quantile_rel_error"] <= 2.0 ** -(B.FINE_MANTISSA_BITS + 1)
