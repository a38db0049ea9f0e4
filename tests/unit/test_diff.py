from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from compute.sparsity.diff import Checkpoint, diff_checkpoints, open_checkpoint, tensor_diff_stats

A = "model.layers.0.mlp.up_proj.weight"
B = "model.layers.1.self_attn.q_proj.weight"


def _constructed() -> tuple[dict, dict]:
    """A: base 0, 10 coords each at delta 0, 5e-9, 5e-8, ..., 5e-4 (70 coords).
    B (4x8): base 1, row 0 += 2^-10, row 1 += 2^-20, rows 2-3 unchanged."""
    levels = [0.0, 5e-9, 5e-8, 5e-7, 5e-6, 5e-5, 5e-4]
    a_t = torch.tensor([v for v in levels for _ in range(10)], dtype=torch.float32)
    b_b = torch.ones(4, 8)
    b_t = b_b.clone()
    b_t[0] += 2.0**-10
    b_t[1] += 2.0**-20
    return {A: torch.zeros(70), B: b_b}, {A: a_t, B: b_t}


def test_constructed_counts_at_each_threshold() -> None:
    base, tuned = _constructed()
    res = diff_checkpoints(base, tuned)
    a, b = res.per_tensor[A], res.per_tensor[B]
    # A: exact 10; |delta| <= 1e-8: 20, 1e-7: 30, 1e-6: 40, 1e-5: 50, 1e-4: 60; bf16 sees every change
    assert a["unchanged_exact"] == pytest.approx(10 / 70)
    assert a["unchanged_bf16"] == pytest.approx(10 / 70)
    for atol, cnt in zip(("1e-08", "1e-07", "1e-06", "1e-05", "0.0001"), (20, 30, 40, 50, 60), strict=True):
        assert a[f"unchanged_atol_{atol}"] == pytest.approx(cnt / 70), atol
    # base rms 0 -> relative thresholds are exact equality
    assert a["unchanged_rel_0.01"] == pytest.approx(10 / 70)
    # B: 1 + 2^-10 and 1 + 2^-20 both round to 1 in bf16
    assert b["unchanged_exact"] == 0.5 and b["unchanged_bf16"] == 1.0
    assert b["unchanged_atol_1e-07"] == 0.5 and b["unchanged_atol_1e-06"] == 0.75
    assert b["unchanged_atol_0.0001"] == 0.75
    assert b["unchanged_rel_0.0001"] == 0.75 and b["unchanged_rel_0.001"] == 1.0  # rms(base) = 1
    # delta is rank 1 (two constant rows), all energy in the first singular value
    assert b["rank"] == 1.0 and b["svd_top1_energy"] == pytest.approx(1.0)
    assert b["max_abs_delta"] == 2.0**-10
    assert b["delta_rms"] == pytest.approx(((8 * 2.0**-20 + 8 * 2.0**-40) / 32) ** 0.5)
    # energy share of the top 5% of B (round(1.6) = 2 coords of 2^-10): 2/8 of row 0's energy share
    e_row0, e_row1 = 8 * 2.0**-20, 8 * 2.0**-40
    assert b["energy_top_5pct"] == pytest.approx(2 * 2.0**-20 / (e_row0 + e_row1))
    g = res.groups["global"]["all"]
    assert g["numel"] == 102
    assert g["unchanged_exact"] == pytest.approx((10 + 16) / 102)
    assert g["unchanged_atol_1e-06"] == pytest.approx((40 + 24) / 102)
    assert res.groups["layer"]["1"]["unchanged_bf16"] == 1.0
    assert res.groups["module"]["up"]["unchanged_atol_1e-05"] == pytest.approx(50 / 70)
    assert res.groups["layer_module"]["0/up"]["numel"] == 70


def test_exact_equality_in_stored_dtype() -> None:
    base = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    tuned = torch.tensor([1.0, 2.0, 3.015625], dtype=torch.bfloat16)  # one bf16 ulp (2^-6) at 3
    s, delta = tensor_diff_stats(base, tuned)
    assert s["unchanged_exact"] == 2 and s["unchanged_bf16"] == 2
    assert delta.dtype == torch.float32 and delta[2] == 0.015625
    assert "rank" not in s  # 1-D


def test_mismatched_architecture_names_first_parameter() -> None:
    base, tuned = _constructed()
    with pytest.raises(ValueError, match=r"tuned: different architecture: parameter 'model.layers.1.self_attn.q_proj.weight' has shape \[4, 8\] in base but \[4, 9\]"):
        diff_checkpoints(base, {**tuned, B: torch.zeros(4, 9)})
    with pytest.raises(ValueError, match="parameter 'extra' is in tuned but not in base"):
        diff_checkpoints(base, {**tuned, "extra": torch.zeros(1)})


def test_fisher_vs_delta() -> None:
    g = torch.Generator().manual_seed(0)
    base = {A: torch.zeros(20, 10), B: torch.zeros(50)}
    tuned = {A: torch.randn(20, 10, generator=g), B: torch.zeros(50)}
    tuned[A][:10] = 0.0  # half of A unchanged, B unchanged
    fisher = {n: t.abs() for n, t in tuned.items()}  # a perfect predictor of |delta|
    res = diff_checkpoints(base, tuned, fisher=fisher, topk_percent=10.0)
    gl = res.fisher["global"]["all"]
    assert res.fisher["settings"]["k"] == 25
    assert gl["precision_at_k"] == 1.0 and gl["jaccard"] == 1.0 and gl["auc"] == 1.0
    assert res.fisher["changed"]["n_changed"] == 100
    assert res.fisher["changed"]["auc"] == 1.0 and res.fisher["changed"]["precision_at_n_changed"] == 1.0
    inv = {n: -t for n, t in fisher.items()}  # anti-predictor
    res = diff_checkpoints(base, tuned, fisher=inv, topk_percent=10.0)
    assert res.fisher["global"]["all"]["precision_at_k"] == 0.0
    with pytest.raises(ValueError, match="fisher: parameter 'nope'"):
        diff_checkpoints(base, tuned, fisher={"nope": torch.zeros(1)})


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def test_checkpoints_from_folders_single_and_sharded(tmp_path) -> None:
    from compute.contract.settings import Settings

    model = _tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[:2] += 1e-3
    model.save_pretrained(tmp_path / "tuned", max_shard_size="4KB")
    assert (tmp_path / "tuned" / "model.safetensors.index.json").is_file()
    settings = Settings(fisherlens_home=tmp_path / "home", allowed_model_roots=str(tmp_path))
    base = open_checkpoint(str(tmp_path / "base"), "base", settings)
    tuned = open_checkpoint(str(tmp_path / "tuned"), "tuned", settings)
    assert base.names() == tuned.names() and len(base.names()) > 5
    res = diff_checkpoints(base, tuned)
    changed = {n for n, v in res.per_tensor.items() if v["unchanged_exact"] < 1.0}
    assert changed == {"model.layers.1.mlp.down_proj.weight"}
    v = res.per_tensor["model.layers.1.mlp.down_proj.weight"]
    assert v["unchanged_exact"] == pytest.approx(1 - 2 / 16)
    assert v["rank"] <= 2.0
    assert res.groups["module"]["down"]["unchanged_exact"] == pytest.approx(1 - 2 * 24 / (2 * 16 * 24))
    with pytest.raises(ValueError, match="tuned: local directory"):
        open_checkpoint("/nonexistent/dir", "tuned", settings)
    other = _tiny_llama(0)
    other.lm_head = torch.nn.Linear(16, 33, bias=False)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="different architecture: parameter 'lm_head.weight'"):
        diff_checkpoints(base, Checkpoint(tmp_path / "other", "tuned"))


@pytest.fixture
def pair(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from tests.unit.fisher_tiny import char_tokenizer, tiny_model

    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(tmp_path))
    monkeypatch.setenv("FISHERLENS_HOME", str(tmp_path / "home"))
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path / "base")
    char_tokenizer().save_pretrained(tmp_path / "base")
    up0 = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[:3] += 0.1  # 3 rows of 16, above bf16 resolution
        model.model.layers[0].self_attn.q_proj.weight[:, :2] += 1e-6  # below bf16 resolution
    model.save_pretrained(tmp_path / "tuned")
    fisher = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    # |delta| of the big changes itself: a perfect predictor of the top |delta|
    fisher["model.layers.1.mlp.up_proj.weight"] = (model.model.layers[1].mlp.up_proj.weight.detach() - up0).abs()
    save_file(fisher, str(tmp_path / "fisher.safetensors"))
    return tmp_path, model


def test_run_diff_job(pair) -> None:
    from compute.jobs.diff import DiffSpec
    from compute.jobs.diff_run import run

    root, model = pair
    total = sum(p.numel() for p in model.parameters())
    up, q = model.model.layers[1].mlp.up_proj.weight, model.model.layers[0].self_attn.q_proj.weight
    n_up, n_q = 3 * up.shape[1], 2 * q.shape[0]
    res = run(DiffSpec(base=str(root / "base"), tuned=str(root / "tuned"),
                       fisher=str(root / "fisher.safetensors"), topk_percent=0.5))
    s = res.summary
    assert s["n_params"] == total
    assert s["unchanged_exact"] == pytest.approx(1 - (n_up + n_q) / total)
    assert s["unchanged_bf16"] == pytest.approx(1 - n_up / total)
    assert s["unchanged_atol_1e-05"] == pytest.approx(1 - n_up / total)
    assert s["unchanged_atol_1e-07"] == pytest.approx(1 - (n_up + n_q) / total)
    names = {h.name for h in res.heatmaps}
    assert {"update_sparsity_exact", "update_sparsity_bf16", "update_sparsity_atol_1e-05",
            "threshold_profile", "fisher_vs_delta_auc"} <= names
    exact = next(h for h in res.heatmaps if h.name == "update_sparsity_exact")
    assert exact.meta["threshold"] == 0.0
    assert exact.z[exact.y_labels.index("1")][exact.x_labels.index("up")] == pytest.approx(1 - 3 / up.shape[0])
    k = round(0.005 * total)
    assert s["overlap_settings"]["k"] == k and k <= n_up
    assert s["precision_at_k"] == 1.0  # top-0.5% Fisher lies inside the 0.1 changes (top |delta|)
    assert s["overlap"][0]["scope"] == "global"
    assert res.tensors == {}
    assert {r.group for r in res.layer_stats} == {"tensor", "layer_module"}
    assert [p.step for p in res.series if p.name == "unchanged/atol"] == [1e-8, 1e-7, 1e-6, 1e-5, 1e-4]


def test_cli_diff(pair, monkeypatch) -> None:
    import json

    from click.testing import CliRunner

    from app.cli import main

    root, model = pair
    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", "")  # the CLI trusts folders named on its command line
    out = root / "d"
    r = CliRunner().invoke(main, ["diff", str(root / "base"), str(root / "tuned"), "--fisher",
                                  str(root / "fisher.safetensors"), "--topk-percent", "0.5", "--store-delta", "--out", str(out)])
    assert r.exit_code == 0, r.output
    # the CLI prints the key numbers the browser shows (one headline policy): same stored dtype,
    # so exact equality leads
    data = json.loads((out / "diff.json").read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    from app.figures.keynumbers import pct

    exact = data["summary"]["unchanged_exact"]
    assert 0 < exact < 1
    assert f"Weights exactly unchanged: {pct(exact)} (both stored in float32" in r.output, r.output
    assert "Unchanged fraction by threshold" in r.output and "Fisher AUC" in r.output, r.output
    assert data["kind"] == "diff" and data["heatmaps"] and data["summary"]["precision_at_k"] == 1.0
    from safetensors.torch import load_file

    delta = load_file(str(out / "delta.safetensors"))
    assert int((delta["model.layers.1.mlp.up_proj.weight"] != 0).sum()) == 3 * 16
    bad = root / "other"
    from tests.unit.fisher_tiny import tiny_model

    tiny_model("qwen3", layers=3).save_pretrained(bad)
    r = CliRunner().invoke(main, ["diff", str(root / "base"), str(bad), "--out", str(out)])
    assert r.exit_code == 2
    assert "error: --tuned: different architecture: parameter 'model.layers.2." in r.output  # refused before loading


@pytest.mark.slow
def test_zoo_diff_and_mask_commands(zoo_home, monkeypatch, tmp_path) -> None:
    """The commands run on the zoo models by name (base vs teacher: a long SFT continuation)."""
    import json

    from click.testing import CliRunner

    from app.cli import main

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    r = CliRunner().invoke(main, ["diff", "arith-base", "arith-teacher", "--out", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "d" / "diff.json").read_text())["summary"]
    n = s["n_params"]
    assert n > 10_000 and 0.0 <= s["unchanged_exact"] <= s["unchanged_bf16"] <= 1.0
    assert s["unchanged_atol_1e-08"] <= s["unchanged_atol_0.0001"]
    r = CliRunner().invoke(main, ["mask", "--select", "magnitude", "--density", "0.01", "--model",
                                  "arith-base", "--out", str(tmp_path / "m.safetensors")])
    assert r.exit_code == 0, r.output
    from compute.sparsity.masks import load_mask

    mask = load_mask(tmp_path / "m.safetensors")
    assert sum(int(m.sum()) for m in mask.values()) == round(0.01 * n)


def test_both_delta_conventions_and_half_ulp_counts_on_hand_made_tensors() -> None:
    """Float32-delta atol columns vs the published bf16-delta columns, and |w|-aware half-ULP counts,
    each element worked out by hand (see the comments)."""
    from compute.sparsity.diff import tensor_diff_stats

    base = torch.tensor([1.0, 1.0, 0.01, 0.0, 1.0])
    tuned = torch.tensor([1.001, 1.005, 0.010002, 1e-9, 1.0])
    # e0: bf16(1.001) == 1.0 -> bf16-equal, bf16 delta 0; fp32 delta 1e-3; below half ULP (2^-8)
    # e1: bf16(1.005) == 1.0078125 -> bf16 delta 2^-7, above every atol; above half ULP
    # e2: fp32 delta 2e-6 (<= 1e-5, > 1e-6); bf16-equal; below half ULP of 0.01 (2^-15)
    # e3: w = 0 -> half ULP 2^-134: a change of 1e-9 is not below; bf16 values differ but the bf16
    #     delta (~1e-9) is <= every atol; fp32 delta <= every atol
    # e4: unchanged
    s, _ = tensor_diff_stats(base, tuned)
    assert s["unchanged_exact"] == 1 and s["unchanged_bf16"] == 3
    assert s["unchanged_atol_1e-08"] == 2 and s["unchanged_atol_1e-06"] == 2
    assert s["unchanged_atol_1e-05"] == 3 and s["unchanged_atol_0.0001"] == 3
    for a in ("1e-08", "1e-06", "1e-05", "0.0001"):
        assert s[f"unchanged_bf16delta_atol_{a}"] == 4, a
    assert s["unchanged_below_half_ulp"] == 3 and s["changed_below_half_ulp"] == 2


def test_half_ulp_is_the_bf16_rounding_threshold() -> None:
    """Brute force: a bf16 weight moved away from zero by just under half an ULP rounds back to
    itself; by just over, it does not."""
    from compute.sparsity.diff import half_ulp_bf16

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(20_000, generator=g) * torch.logspace(-6, 1, 20_000)).to(torch.bfloat16).float()
    w = w[w != 0]
    h = half_ulp_bf16(w)
    assert torch.equal((w + torch.sign(w) * 0.99 * h).to(torch.bfloat16).float(), w)
    assert not bool(((w + torch.sign(w) * 1.01 * h).to(torch.bfloat16).float() == w).any())
    assert float(half_ulp_bf16(torch.tensor([0.0]))) == 2.0**-134
    r = (h / w.abs())
    assert float(r.min()) >= 2.0**-9 and float(r.max()) <= 2.0**-8


def test_fisher_auc_within_weight_binades() -> None:
    from compute.sparsity.diff import fisher_auc_by_weight_binade

    # bin [0.5, 1): never changes, high Fisher; bin [2^-7, 2^-6): Fisher ranks the changed ones first
    base = {"w": torch.tensor([0.75] * 4 + [0.01] * 4)}
    fisher = {"w": torch.tensor([10.0, 11.0, 12.0, 13.0, 1.0, 2.0, 3.0, 4.0])}
    changed = {"w": torch.tensor([False] * 4 + [False, False, True, True])}
    res = fisher_auc_by_weight_binade(fisher, changed, base, min_each=1)
    from compute.sparsity.overlap import roc_auc

    assert roc_auc(fisher["w"], changed["w"]) == pytest.approx(4 / 12)  # globally worse than chance
    assert res["pooled_auc"] == pytest.approx(1.0)  # within equal-ULP bins, perfect
    by_e = {b["exponent"]: b for b in res["bins"]}
    assert by_e[0]["n_changed"] == 0 and math.isnan(by_e[0]["auc"])
    assert by_e[-6]["auc"] == pytest.approx(1.0) and by_e[-6]["abs_w_lo"] == 2.0**-7


def test_tensor_diff_stats_in_chunks_equals_one_pass() -> None:
    """tensor_diff_stats bounds its temporaries by chunks (issue 30): the counts are the same
    whatever the chunk, the sums and energy shares equal to float64 rounding."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(37, 29, generator=g)
    base[0, :5] = 0.0
    tuned = base.clone()
    sel = torch.rand(base.shape, generator=g) < 0.3
    tuned[sel] += 1e-3 * torch.randn(int(sel.sum()), generator=g)
    tuned[0, 0] = 1e-30  # changed from zero
    whole, d1 = tensor_diff_stats(base, tuned, chunk=1 << 22)
    parts, d2 = tensor_diff_stats(base, tuned, chunk=7)
    assert d1 is not None and d2 is not None and torch.equal(d1, d2)
    assert whole.keys() == parts.keys()
    for k, v in whole.items():
        if k.startswith(("unchanged_", "changed_", "zero_", "numel", "rank")):
            assert parts[k] == v, k
        else:
            assert parts[k] == pytest.approx(v, rel=1e-12), k
    assert whole["unchanged_exact"] == float((base == tuned).sum())
    assert whole["changed_from_zero"] == float(((base == 0) & (base != tuned)).sum()) >= 1
    _, none = tensor_diff_stats(base, tuned, svd_max_numel=0, need_delta=False)
    assert none is None


@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_energy_shares_are_the_sums_of_the_largest_squares(chunk: int) -> None:
    """energy_top_<p>pct from the streaming histogram (issue 30: no running top-k of the squares)
    equals the sum of the k largest squared deltas of a full sort over their total, k = round(p n),
    with ties, zeros and a few large deltas."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(53, 41, generator=g)
    tuned = base.clone()
    sel = torch.rand(base.shape, generator=g) < 0.2
    tuned[sel] += 1e-3 * torch.randn(int(sel.sum()), generator=g)
    tuned[1, :9] = base[1, :9] + 0.5  # equal deltas (ties at a cut)
    tuned[2, 3] = base[2, 3] + 10.0
    stats, _ = tensor_diff_stats(base, tuned, need_delta=False, svd_max_numel=0, chunk=chunk)
    sq = (tuned - base).abs().square().reshape(-1).double()
    desc = sq.sort(descending=True).values
    n = sq.numel()
    for p in (0.1, 1.0, 5.0):
        k = max(1, int(math.floor(p / 100 * n + 0.5)))
        assert stats[f"energy_top_{p:g}pct"] == pytest.approx(float(desc[:k].sum() / sq.sum()), rel=1e-12)
    same, _ = tensor_diff_stats(base, base.clone(), need_delta=False, svd_max_numel=0, chunk=chunk)
    assert math.isnan(same["energy_top_1pct"])  # no delta: no share


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_a_base_read_a_row_slice_at_a_time_gives_the_same_stats(tmp_path, stored) -> None:
    """The train job's diff reads its base from the model file a slice of rows at a time
    (LazyTensor, issue 30: not the whole largest tensor): every count and sum equals the one from
    the whole tensor, with chunks that cut rows anywhere, for 2-D, 1-D and 0-D tensors."""
    from safetensors.torch import save_file

    from compute.sparsity.diff import LazyTensor

    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(10, 13, generator=g).to(stored), "b": torch.randn(29, generator=g).to(stored),
            "s": torch.tensor(0.5).to(stored)}
    save_file(base, str(tmp_path / "model.safetensors"))
    ck = Checkpoint(tmp_path)
    for name, w in base.items():
        tuned = w.float() + (torch.rand(w.shape, generator=g) < 0.3) * 1e-3
        for chunk in (1, 7, 37, 1 << 20):
            lazy = LazyTensor(ck, name, torch.float32, lambda t: t.to(torch.float32))
            got, _ = tensor_diff_stats(lazy, tuned, svd_max_numel=0, need_delta=False, chunk=chunk)
            want, _ = tensor_diff_stats(w.float(), tuned, svd_max_numel=0, need_delta=False, chunk=chunk)
            assert got.keys() == want.keys(), (name, chunk)
            assert all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in got), (name, chunk)
        for i, j in ((0, 1), (5, 31), (12, w.numel())):
            assert torch.equal(ck.get_flat(name, i, j), w.reshape(-1)[i:j])


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_file_base_is_checked_a_slice_at_a_time_and_refuses_a_changed_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                           precision: str) -> None:
    """The train job compares its base from the model's file only when every parameter read back
    (as the job prepared it: loaded dtype, training precision, stored dtype) equals the model's bit
    for bit; the check reads slices of DIFF_CHUNK values (here 1,000: several per tensor), and one
    value changed in the last slice of the largest tensor makes it keep a copy instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from compute.jobs import train_run
    from compute.sparsity import diff as diff_mod
    from compute.sparsity.diff import Checkpoint
    from compute.train import prepare_precision

    monkeypatch.setattr(diff_mod, "DIFF_CHUNK", 1000)
    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(tmp_path))
    reads: list[int] = []
    real = Checkpoint.get_flat
    monkeypatch.setattr(Checkpoint, "get_flat", lambda self, n, i, j: reads.append(j - i) or real(self, n, i, j))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    model = prepare_precision(LlamaForCausalLM.from_pretrained(tmp_path / "m"), precision)
    base = train_run.FileBase(model, Checkpoint(tmp_path / "m"), "float32", precision)
    assert base.matches_model()
    assert reads and max(reads) <= 1000 + 32  # whole rows that hold a slice: never the 9,600-value table
    src = train_run.base_source(model, str(tmp_path / "m"), "float32", precision)
    assert isinstance(src, train_run.FileBase)
    with torch.no_grad():
        model.model.embed_tokens.weight.view(-1)[-1] += 1.0
    assert not base.matches_model()
    kept = train_run.base_source(model, str(tmp_path / "m"), "float32", precision)
    assert isinstance(kept, dict) and torch.equal(kept["model.embed_tokens.weight"],
                                                  model.model.embed_tokens.weight.detach().to(kept["model.embed_tokens.weight"].dtype))
