"""Plot builders: figures have the expected traces, axes and values for hand-made result dicts."""

from __future__ import annotations

import math

import pytest

from app import plots


def _stat(param, module, layer, group="tensor", **values):
    return {"param": param, "module": module, "layer": layer, "values": values, "group": group}


@pytest.fixture
def fisher_result():
    # layer 0: q (2 tensors: mass 2 over 4 coords, mass 6 over 4 coords), up: mass 0 (zero Fisher)
    # layer 1: q mass 12 over 4 coords; no layer: embed mass 20 over 10 coords. Total mass 40.
    return {
        "kind": "fisher",
        "summary": {"gini": 0.5, "n_samples": 8},
        "layer_stats": [
            _stat("model.layers.0.self_attn.q_proj.weight", "q", 0, mass=2.0, numel=4, mean=0.5, max=1.0),
            _stat("model.layers.0.self_attn.q_proj.bias", "q", 0, mass=6.0, numel=4, mean=1.5, max=3.0),
            _stat("model.layers.0.mlp.up_proj.weight", "up", 0, mass=0.0, numel=8, mean=0.0, max=0.0),
            _stat("model.layers.1.self_attn.q_proj.weight", "q", 1, mass=12.0, numel=4, mean=3.0, max=5.0),
            _stat("model.embed_tokens.weight", "embed", None, mass=20.0, numel=10, mean=2.0, max=9.0),
        ],
        "heatmaps": [],
        "series": [{"name": "concentration", "step": x, "value": y}
                   for x, y in ((0.5, 0.9), (0.01, 0.3), (0.1, 0.6), (1.0, 1.0))],
    }


def test_layer_module_cells_aggregate_exactly(fisher_result):
    cells = plots.layer_module_cells(fisher_result)
    q0 = cells[(0, "q")]
    assert q0["mean"] == pytest.approx(8.0 / 8)  # (2 + 6) / (4 + 4)
    assert q0["share"] == pytest.approx(8.0 / 40)
    assert q0["max"] == 3.0
    assert len(q0["params"]) == 2
    assert cells[(None, "embed")]["share"] == pytest.approx(0.5)
    assert cells[(0, "up")]["mean"] == 0.0


def test_fisher_heatmap_log_scale_axes_and_hover(fisher_result):
    fig = plots.layer_module_heatmap(fisher_result, "mean")
    (tr,) = fig.data
    assert tr.type == "heatmap"
    assert list(tr.x) == ["embed", "q", "up"]  # canonical module order
    assert list(tr.y) == ["0", "1", "embeddings"]  # layers, then the parameters outside the blocks, named
    z = [list(r) for r in tr.z]
    assert z[0][1] == pytest.approx(math.log10(1.0))  # layer 0, q: mean 1.0
    assert z[1][1] == pytest.approx(math.log10(3.0))
    assert z[2][0] == pytest.approx(math.log10(2.0))
    assert z[0][2] is None  # zero Fisher cannot be shown on a log scale: blank cell
    assert z[1][0] is None and z[1][2] is None  # no such parameters
    hover = tr.customdata[0][1]
    assert "model.layers.0.self_attn.q_proj.weight" in hover and "mean=1" in hover
    assert "share=0.2" in hover
    assert list(tr.colorbar.ticktext)[0].startswith("1e")

    share = plots.layer_module_heatmap(fisher_result, "share", log=False).data[0]
    assert share.z[2][0] == pytest.approx(0.5)
    assert share.z[1][1] == pytest.approx(0.3)


def test_layer_module_rows_used_when_no_tensor_rows():
    res = {"kind": "fisher", "layer_stats": [
        _stat("", "q", 0, group="layer_module", mean=0.25, share=0.4),
        _stat("", "down", 1, group="layer_module", mean=0.5, share=0.6),
    ]}
    tr = plots.layer_module_heatmap(res, "share", log=False).data[0]
    assert list(tr.x) == ["q", "down"]
    assert tr.z[0][0] == pytest.approx(0.4) and tr.z[1][1] == pytest.approx(0.6)
    assert "(aggregate)" in tr.customdata[0][0]


def test_per_layer_bars_stack_by_module(fisher_result):
    fig = plots.per_layer_bars(fisher_result, "share")
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"embed", "q", "up"}
    assert list(by_name["q"].x) == ["0", "1"]  # a block module has nothing outside the blocks
    assert list(by_name["q"].y) == pytest.approx([0.2, 0.3])
    assert list(by_name["embed"].x) == ["0", "1", "embeddings"] and by_name["embed"].y[2] == pytest.approx(0.5)
    assert fig.layout.barmode == "stack"


def test_concentration_sorted_with_uniform_reference(fisher_result):
    fig = plots.concentration_figure(fisher_result)
    curve, ref = fig.data
    assert list(curve.x) == [0.01, 0.1, 0.5, 1.0]
    assert list(curve.y) == [0.3, 0.6, 0.9, 1.0]
    assert list(ref.y) == [0, 1]
    assert "Gini 0.5" in fig.layout.title.text


def test_pool_matrix_block_means_and_labels():
    z = [[float(i * 10 + j) for j in range(10)] for i in range(4)]
    pz, xl, yl = plots.pool_matrix(z, [str(j) for j in range(10)], ["a", "b", "c", "d"], max_axis=5)
    assert len(pz[0]) == 5 and len(pz) == 4
    assert pz[0][0] == pytest.approx(0.5)  # mean of 0, 1
    assert pz[3][4] == pytest.approx(38.5)  # mean of 38, 39
    assert xl[0] == "0..1" and yl == ["a", "b", "c", "d"]


def test_big_heatmap_pooled_under_cell_budget():
    n = 1000  # e.g. vocabulary x hidden
    hm = {"name": "vocab", "x_labels": [str(i) for i in range(n)], "y_labels": [str(i) for i in range(n)],
          "z": [[1.0] * n for _ in range(n)], "meta": {}}
    tr = plots.heatmap_figure(hm).data[0]
    assert len(tr.z) * len(tr.z[0]) <= plots.MAX_CELLS
    assert len(tr.x) <= plots.MAX_AXIS and tr.z[0][0] == 1.0


def test_update_sparsity_slider_one_frame_per_threshold():
    hms = [{"name": f"update_sparsity_atol_{t:g}", "x_labels": ["q", "up"], "y_labels": ["0", "1"],
            "z": [[f, f], [f, 1.0]], "meta": {"threshold": t}}
           for t, f in ((1e-5, 0.9), (1e-8, 0.5), (1e-6, 0.7))]
    fig = plots.update_sparsity_heatmap({"kind": "diff", "heatmaps": hms})
    assert [t.name for t in fig.data] == ["1e-08", "1e-06", "1e-05"]  # sorted by threshold
    assert [t.visible for t in fig.data] == [True, False, False]
    steps = fig.layout.sliders[0].steps
    assert [s.label for s in steps] == ["1e-08", "1e-06", "1e-05"]
    assert steps[2].args[0]["visible"] == [False, False, True]
    assert fig.data[0].z[0][0] == 0.5 and fig.data[0].zmax == 1.0


def test_mask_density_from_layer_stats_weighted_by_numel():
    res = {"kind": "mask", "layer_stats": [
        _stat("a", "q", 0, density=0.5, numel=2), _stat("b", "q", 0, density=0.0, numel=6),
        _stat("c", "up", 0, density=1.0, numel=4)]}
    tr = plots.mask_density_heatmap(res).data[0]
    assert list(tr.x) == ["q", "up"]
    assert tr.z[0][0] == pytest.approx(1.0 / 8) and tr.z[0][1] == 1.0


def test_bound_scatter_downsampled_with_bound_line():
    series = [{"name": "bound/|grad|", "step": (i + 1) * 1e-3, "value": (i + 1) * 5e-4} for i in range(10_000)]
    res = {"kind": "train", "summary": {"bound_constant": 2.0, "bound_holds_fraction": 1.0}, "series": series}
    fig = plots.bound_scatter(res, max_points=500)
    pts, line = fig.data
    assert len(pts.x) == 500
    assert all(y == pytest.approx(x / 2) for x, y in zip(pts.x, pts.y, strict=True))
    assert list(line.y) == pytest.approx([2.0 * line.x[0], 2.0 * line.x[1]])
    assert fig.layout.xaxis.type == "log" and "500 of 10000" in fig.layout.title.text
    assert plots.bound_scatter(res, max_points=500).data[0].x == pts.x  # deterministic


def test_curves_one_line_per_mask_and_metric_menu():
    groups: dict = {"reward": {}, "loss": {}}
    for run, slope in (("full", 1.0), ("fisher-0.05", 0.5)):
        groups["reward"][run] = ([0, 1, 2], [0.0, slope, 2 * slope])
        groups["loss"][run] = ([0, 1, 2], [0, -1, -2])
    fig = plots.curves_figure(groups, "Training curves")
    visible = [t for t in fig.data if t.visible]
    assert sorted(t.name for t in visible) == ["fisher-0.05", "full"]
    full = next(t for t in visible if t.name == "full")
    assert list(full.x) == [0, 1, 2] and list(full.y) == [0, 1, 2]
    assert fig.layout.yaxis.title.text == "reward"
    buttons = fig.layout.updatemenus[0].buttons
    assert [b.label for b in buttons] == ["reward", "loss"]


def test_tables():
    # compute.jobs.retention_run's summary: base/full rewards and one row per (selector, density)
    res = {"kind": "retention", "summary": {
        "rows": [{"selector": "fisher", "density": 0.05, "retention_mean": 0.91234567, "retention_std": 0.1,
                  "rewards": [0.5, 0.6]},
                 {"selector": "random", "density": 0.05, "retention_mean": 0.5, "retention_std": 0.2}],
        "overlap": {"global": {"precision_at_k": 0.3, "auc": 0.8}, "q": {"precision_at_k": 0.1, "auc": 0.6}},
        "base_reward": 0.2, "full_reward_mean": 0.8, "full_reward_std": 0.05}}
    h, rows = plots.retention_table(res)
    assert h[:2] == ["selector", "density"] and "rewards" not in h  # per-seed lists left out
    assert [r[0] for r in rows] == ["(base, no training)", "(full training)", "fisher", "random"]
    assert rows[0][h.index("reward_mean")] == 0.2 and rows[1][h.index("reward_mean")] == 0.8
    assert rows[2][h.index("retention_mean")] == pytest.approx(0.9123)
    h, rows = plots.overlap_table(res)
    assert h[0] == "scope" and rows[1] == ["q", 0.1, 0.6]
    h, rows = plots.summary_table(res)
    assert h == ["group", "quantity", "value"] and ["", "Base reward", 0.2] in rows


def test_token_figures_and_choices():
    res = {"kind": "tokens", "summary": {
        "context": "12+34=",
        "top_tokens": [{"token": "4", "prob": 0.6, "share": 0.1}, {"token": " ", "prob": 0.3, "share": 0.5}],
        "random_tokens": [{"token": "x", "prob": 0.001, "share": 0.4}]},
        "heatmaps": [{"name": "similarity_top", "x_labels": ["4", " "], "y_labels": ["4", " "],
                      "z": [[1.0, 0.9], [0.9, 1.0]], "meta": {}},
                     {"name": "similarity_random", "x_labels": ["x"], "y_labels": ["x"], "z": [[1.0]],
                      "meta": {}}]}
    bars = plots.token_bars(res)
    assert [t.name for t in bars.data] == ["probability (top)", "share of Fisher (top)",
                                          "probability (random)", "share of Fisher (random)"]
    assert list(bars.data[0].y) == [0.6, 0.3] and list(bars.data[0].x) == ["4", "\u2423"]
    sim = plots.token_similarity_heatmap(res, "top").data[0]
    assert sim.zmin == -1.0 and sim.z[0][1] == 0.9
    assert plots.token_similarity_heatmap(res, "random").data[0].z[0][0] == 1.0
    assert plots.token_choices(res)[0][1] == "4"
    titles = [t for t, _ in plots.result_figures(res)]
    assert titles == ["tokens", "similarity_top", "similarity_random"]


def test_result_figures_for_fisher(fisher_result):
    titles = [t for t, _ in plots.result_figures(fisher_result)]
    assert titles[:4] == ["fisher_mean", "fisher_share", "per_layer", "concentration"]
    # figures serialise to JSON (what Gradio sends to the browser)
    for _, fig in plots.result_figures(fisher_result):
        assert fig.to_json()


def test_empty_result_gives_message_figures():
    res = {"kind": "fisher", "layer_stats": [], "series": [], "heatmaps": []}
    assert plots.result_figures(res) == []
    fig = plots.layer_module_heatmap(res)
    assert "no per-layer" in fig.layout.annotations[0].text


def test_train_job_curves_bound_and_eval():
    # compute.jobs.train_run names: train/<metric>, eval/accuracy, bound/|grad| and bound/rhs points
    series = [{"name": "train/reward", "step": s, "value": 0.1 * s} for s in range(1, 4)]
    series += [{"name": "train/loss", "step": s, "value": 1.0 / s} for s in range(1, 4)]
    series += [{"name": "eval/accuracy", "step": 0, "value": 0.2}, {"name": "eval/accuracy", "step": 3, "value": 0.5}]
    series += [{"name": "bound/|grad|", "step": x, "value": 0.5 * x} for x in (1e-3, 1e-2, 1e-1)]
    series += [{"name": "bound/rhs", "step": x, "value": 2.0 * x} for x in (1e-3, 1e-2, 1e-1)]
    res = {"kind": "train", "series": series, "heatmaps": [], "layer_stats": [],
           "summary": {"bound": {"bound_rms_advantage": 2.0, "bound_fraction_holds": 1.0}}}
    fig = plots.training_curves(res)
    assert fig.layout.yaxis.title.text == "reward"
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["reward", "held-out accuracy (greedy)", "loss"]
    held = [t for t in fig.data if t.name == "this run" and list(t.x) == [0, 3]]
    assert len(held) == 1 and list(held[0].y) == [0.2, 0.5]  # eval/accuracy before and after
    reward = next(t for t in fig.data if t.visible)
    assert list(reward.y) == pytest.approx([0.1, 0.2, 0.3])
    pts, line = plots.bound_scatter(res).data
    assert list(pts.y) == pytest.approx([0.5e-3, 0.5e-2, 0.5e-1])
    assert list(line.y) == pytest.approx([2e-3, 2e-1])  # sqrt(E[A^2]) * sqrt(F) at the ends
    assert "holds for 100% of coordinates" in plots.bound_scatter(res).layout.title.text
    titles = [t for t, _ in plots.result_figures(res)]
    assert titles == ["bound", "training"]


def test_retention_and_diff_figures():
    ret = {"kind": "retention", "summary": {}, "layer_stats": [], "series": [
        {"name": "retention/fisher", "step": 0.01, "value": 0.5}, {"name": "retention/fisher", "step": 0.1, "value": 0.9},
        {"name": "retention/random", "step": 0.01, "value": 0.1}, {"name": "heldout/fisher", "step": 0.01, "value": 0.3},
        {"name": "train_reward/full", "step": 1, "value": 0.2}, {"name": "train_reward/fisher@0.01", "step": 1, "value": 0.1}],
        "heatmaps": [{"name": "retention", "x_labels": ["0.01", "0.1"], "y_labels": ["fisher", "random"],
                      "z": [[0.5, 0.9], [0.1, None]], "meta": {}}]}
    figs = dict(plots.result_figures(ret))
    assert list(figs) == ["retention_curve", "training", "retention"]
    curve = figs["retention_curve"]  # from the series when the summary has no rows
    assert sorted(t.name for t in curve.data if t.visible) == ["fisher", "random"]
    assert curve.layout.xaxis.type == "log" and curve.layout.xaxis.title.text == "density"
    rows = [{"selector": "fisher", "density": 0.1, "retention_mean": 0.9, "retention_std": 0.05, "retentions": [0.85, 0.95]},
            {"selector": "fisher", "density": 0.01, "retention_mean": 0.4, "retention_std": 0.1, "retentions": [0.3, 0.5]},
            {"selector": "random", "density": 0.01, "retention_mean": 0.2, "retention_std": 0.0}]
    fig = plots.retention_figure({"kind": "retention", "summary": {"rows": rows}})
    fisher = next(t for t in fig.data if t.name == "fisher")
    assert list(fisher.x) == [0.01, 0.1] and list(fisher.y) == [0.4, 0.9]
    assert list(fisher.error_y.array) == [0.1, 0.05]
    assert sorted(t.name for t in figs["training"].data) == ["fisher@0.01", "full"]

    diff = {"kind": "diff", "summary": {}, "layer_stats": [], "series": [
        {"name": "unchanged/atol", "step": 1e-8, "value": 0.2}, {"name": "unchanged/atol", "step": 1e-5, "value": 0.7}],
        "heatmaps": [
            {"name": "update_sparsity_exact", "x_labels": ["q"], "y_labels": ["0"], "z": [[0.1]],
             "meta": {"threshold": 0.0, "threshold_label": "exact equality"}},
            {"name": "update_sparsity_bf16", "x_labels": ["q"], "y_labels": ["0"], "z": [[0.4]],
             "meta": {"threshold_label": "equal after casting both to bf16"}},
            {"name": "threshold_profile", "x_labels": ["exact"], "y_labels": ["0"], "z": [[0.1]], "meta": {}}]}
    figs = dict(plots.result_figures(diff))
    assert list(figs) == ["update_sparsity", "unchanged_curve", "threshold_profile"]
    assert [t.name for t in figs["update_sparsity"].data] == ["exact equality", "equal after casting both to bf16"]
    assert list(figs["unchanged_curve"].data[0].y) == [0.2, 0.7]


def test_fisher_runner_heatmaps_not_drawn_twice(fisher_result):
    res = {**fisher_result, "heatmaps": [
        {"name": "fisher/mean", "x_labels": ["q"], "y_labels": ["0"], "z": [[1.0]], "meta": {}},
        {"name": "fisher/share", "x_labels": ["q"], "y_labels": ["0"], "z": [[1.0]], "meta": {}}],
        "summary": {"exact_output": {"lm_head.weight": {"relative_l1_error": 0.01, "mc_mass": 1.0, "exact_mass": 1.01}}}}
    assert [t for t, _ in plots.result_figures(res)] == ["fisher_mean", "fisher_share", "per_layer", "concentration"]
    tables = dict(plots.result_tables(res))
    h, rows = tables["Exact output-layer check (Monte-Carlo vs closed form)"]
    assert h == ["param", "relative_l1_error", "mc_mass", "exact_mass"] and rows[0][0] == "lm_head.weight"


def test_generic_heatmap_axes_order_and_titles():
    hm = {"name": "fisher_vs_delta_auc", "x_labels": ["lm_head", "q", "embed"], "y_labels": ["0", "-"],
          "z": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], "meta": {"x_title": "module type", "y_title": "layer"}}
    fig = plots.heatmap_figure(hm)
    tr = fig.data[0]
    assert list(tr.x) == ["embed", "q", "lm_head"]
    # the row outside the blocks is split into one named row per filled module, numbers unchanged
    assert list(tr.y) == ["0", "embeddings", "q (outside the blocks)", "lm_head"]
    assert [list(r) for r in tr.z] == [[3.0, 2.0, 1.0], [6.0, None, None], [None, 5.0, None], [None, None, 4.0]]
    assert fig.layout.yaxis.autorange == "reversed" and fig.layout.xaxis.title.text == "module type"
    assert "ROC-AUC" in fig.layout.title.text
    hist = {"name": "bound_log_hist", "x_labels": ["-2.0", "-1.0"], "y_labels": ["-2.0", "-1.0"],
            "z": [[10.0, None], [1.0, 100.0]], "meta": {"x": "log10 sqrt(F_i)", "y": "log10 |g_i|"}}
    fig = plots.heatmap_figure(hist, log=True)
    assert fig.layout.yaxis.autorange is True and fig.layout.yaxis.title.text == "log10 |g_i|"
    assert fig.data[0].z[1][1] == pytest.approx(2.0) and fig.data[0].customdata[1][1] == "100"


def test_compare_shares_one_colour_range():
    a = plots.heatmap_figure({"name": "x", "x_labels": ["q"], "y_labels": ["0", "1"], "z": [[1.0], [2.0]], "meta": {}})
    b = plots.heatmap_figure({"name": "x", "x_labels": ["q"], "y_labels": ["0", "1"], "z": [[0.5], [5.0]], "meta": {}})
    plots.share_colour_range(a, b)
    assert (a.data[0].zmin, a.data[0].zmax) == (0.5, 5.0) == (b.data[0].zmin, b.data[0].zmax)
