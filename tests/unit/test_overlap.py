from __future__ import annotations

import math

import pytest
import torch

from compute.sparsity.overlap import (
    jaccard_baseline,
    mask_overlap,
    midranks,
    precision_at_k,
    roc_auc,
    score_vs_target,
    set_overlap,
    spearman,
)


def _pairwise_auc(score: torch.Tensor, labels: torch.Tensor) -> float:
    pos, neg = score[labels], score[~labels]
    wins = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    return float(wins.mean())


def test_midranks_hand() -> None:
    assert midranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert midranks(torch.tensor([5.0, 5.0, 5.0])).tolist() == [2.0, 2.0, 2.0]


def test_auc_hand_and_brute_force() -> None:
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]).bool()) == 0.75
    # ties: pos {1, 2}, neg {1, 0}: 0.5 + 1 + 1 + 1 = 3.5 of 4 pairs
    assert roc_auc(torch.tensor([1.0, 1.0, 2.0, 0.0]), torch.tensor([1, 0, 1, 0]).bool()) == 0.875
    assert math.isnan(roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([True, True])))
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 5, (200,), generator=g).float()
    lab = torch.rand(200, generator=g) < 0.3
    assert roc_auc(s, lab) == pytest.approx(_pairwise_auc(s, lab), abs=1e-12)


def test_spearman_hand() -> None:
    # no ties: rho = 1 - 6 sum d^2 / (n (n^2 - 1)) = 1 - 12/60
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, 3, 2, 4])) == pytest.approx(0.8)
    assert spearman(torch.tensor([1.0, 2, 3]), torch.tensor([30.0, 20, 10])) == pytest.approx(-1.0)
    # ties: ranks x = [1.5, 1.5, 3], y = [1, 2, 3]; Pearson by hand = 0.75 / sqrt(0.5 * 2)
    rx = torch.tensor([1.5, 1.5, 3.0]) - 2.0
    ry = torch.tensor([1.0, 2.0, 3.0]) - 2.0
    want = float((rx * ry).sum() / torch.sqrt((rx * rx).sum() * (ry * ry).sum()))
    assert spearman(torch.tensor([0.0, 0, 1]), torch.tensor([1.0, 2, 3])) == pytest.approx(want)
    assert math.isnan(spearman(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0])))


def test_set_overlap_hand() -> None:
    # N = 10, A = {0,1,2,3}, B = {2,3,4}
    m = set_overlap(10, 4, 3, 2)
    assert m["jaccard"] == pytest.approx(2 / 5)
    assert m["overlap_frac_a"] == 0.5 and m["intersection_frac"] == 0.2
    assert m["intersection_baseline"] == pytest.approx(0.12)
    assert m["jaccard_baseline"] == pytest.approx(0.12 / 0.58)
    assert m["jaccard_lift"] == pytest.approx(0.4 / (0.12 / 0.58))
    assert jaccard_baseline(1.0, 0.3) == pytest.approx(0.3)


def test_jaccard_baseline_matches_random_masks() -> None:
    g = torch.Generator().manual_seed(0)
    n, js = 20000, []
    for _ in range(20):
        a = torch.rand(n, generator=g) < 0.1
        b = torch.rand(n, generator=g) < 0.2
        js.append(int((a & b).sum()) / int((a | b).sum()))
    assert sum(js) / len(js) == pytest.approx(jaccard_baseline(0.1, 0.2), rel=0.05)


def test_mask_overlap_per_layer() -> None:
    a = {
        "model.layers.0.mlp.up_proj.weight": torch.tensor([1, 1, 0, 0]).bool(),
        "model.layers.1.mlp.up_proj.weight": torch.tensor([1, 0, 0, 0]).bool(),
    }
    b = {
        "model.layers.0.mlp.up_proj.weight": torch.tensor([1, 0, 1, 0]).bool(),
        "model.layers.1.mlp.up_proj.weight": torch.tensor([0, 1, 0, 0]).bool(),
    }
    g = mask_overlap(a, b)["all"]
    assert (g["overlap"], g["jaccard"]) == (1.0, pytest.approx(1 / 5))  # union = 3 + 3 - 1
    per = mask_overlap(a, b, "layer")
    assert per["0"]["jaccard"] == pytest.approx(1 / 3) and per["1"]["jaccard"] == 0.0
    assert mask_overlap(a, b, "module")["up"]["overlap"] == 1.0


def test_precision_at_k_hand() -> None:
    score = {"w": torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])}
    target = {"w": torch.tensor([1, 0, 1, 0, 0]).bool()}
    assert precision_at_k(score, target) == 0.5  # top-2 = {0, 1}, 1 of 2 in target
    assert precision_at_k(score, target, k=3) == pytest.approx(2 / 3)


def _layered(seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    score = {
        "model.layers.0.self_attn.q_proj.weight": torch.rand(8, 8, generator=g),
        "model.layers.1.mlp.down_proj.weight": torch.rand(8, 16, generator=g),
        "model.norm.weight": torch.rand(8, generator=g),
    }
    target = {n: s + 0.5 * torch.rand(s.shape, generator=g) for n, s in score.items()}
    return score, target


def test_score_vs_target_exact() -> None:
    score, target = _layered()
    res = score_vs_target(score, target, 0.1)
    total = 64 + 128 + 8
    k = round(0.1 * total)
    gl = res["global"]["all"]
    assert res["settings"]["k"] == k and not res["settings"]["rank_stats_sampled"]
    assert gl["n_a"] == gl["n_b"] == k
    flat_s = torch.cat([score[n].flatten() for n in sorted(score)])
    flat_t = torch.cat([target[n].flatten() for n in sorted(score)])
    top_s = set(torch.topk(flat_s, k).indices.tolist())
    top_t = set(torch.topk(flat_t, k).indices.tolist())
    assert gl["precision_at_k"] == pytest.approx(len(top_s & top_t) / k)
    assert gl["jaccard"] == pytest.approx(len(top_s & top_t) / len(top_s | top_t))
    lab = torch.zeros(total, dtype=torch.bool)
    lab[list(top_t)] = True
    assert gl["auc"] == pytest.approx(_pairwise_auc(flat_s, lab))
    assert gl["spearman"] > 0.5
    # group numbers restrict the global sets: counts add up over layers
    assert sum(m["overlap"] for m in res["layer"].values()) == gl["overlap"]
    assert set(res["module"]) == {"q", "down", "norm"} and set(res["layer"]) == {"0", "1", "-"}
    assert "0/q" in res["layer_module"]


def test_score_vs_target_sampled_is_deterministic_and_close() -> None:
    score, target = _layered(1)
    exact = score_vs_target(score, target, 0.2, by=("global",))
    s1 = score_vs_target(score, target, 0.2, by=("global",), cap=150)
    s2 = score_vs_target(score, target, 0.2, by=("global",), cap=150)
    assert s1["settings"]["rank_stats_sampled"] and s1["settings"]["rank_stats_cap"] == 150
    assert s1["settings"]["rank_stats_n"] == pytest.approx(150, abs=3)
    assert s1["global"]["all"]["auc"] == s2["global"]["all"]["auc"]
    assert s1["global"]["all"]["auc"] == pytest.approx(exact["global"]["all"]["auc"], abs=0.1)
    # set metrics are never sampled
    assert s1["global"]["all"]["jaccard"] == exact["global"]["all"]["jaccard"]


def test_score_vs_target_errors() -> None:
    score, target = _layered()
    with pytest.raises(ValueError, match="fisher: parameter"):
        score_vs_target(score, {n: t for n, t in list(target.items())[:1]}, 0.1)
    with pytest.raises(ValueError, match="topk_percent"):
        score_vs_target(score, target, 1e-6)


def test_concentration_scores_the_fisher_against_each_target_per_group() -> None:
    from compute.sparsity.overlap import concentration, roc_auc

    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    fisher = {a: torch.arange(10.0).reshape(2, 5), b: torch.arange(10.0, 20.0).reshape(2, 5)}
    # sum g^2 ranked exactly like the Fisher; |delta| ranked in reverse
    grad_sq = {n: f * 2 + 1 for n, f in fisher.items()}
    delta = {n: -f for n, f in fisher.items()}
    res = concentration(fisher, {"grad_sq_sum": grad_sq, "abs_delta": delta}, fraction=0.2)
    g = res["grad_sq_sum"]["global"]["all"]
    assert g["precision_at_k"] == 1.0 and g["auc"] == 1.0 and g["spearman"] == pytest.approx(1.0)
    d = res["abs_delta"]["global"]["all"]
    assert d["precision_at_k"] == 0.0 and d["auc"] == 0.0 and d["spearman"] == pytest.approx(-1.0)
    # the top 20% (4 coordinates) all lie in layer 1: layer 0 has no target member, so no AUC there
    lay = res["grad_sq_sum"]["layer"]
    assert lay["1"]["n_b"] == 4 and lay["1"]["auc"] == pytest.approx(
        roc_auc(fisher[b].flatten(), torch.tensor([False] * 6 + [True] * 4)))
    assert math.isnan(lay["0"]["auc"]) and set(res["grad_sq_sum"]["module"]) == {"up", "q"}
    with pytest.raises(ValueError, match="^fisher:"):
        concentration(fisher, {"x": {"other": torch.ones(3)}})
