"""compute.sparsity.series against hand values and brute force (compute.sparsity.diff, compute.sparsity.overlap)
on synthetic run folders, and on a real TRL GRPOTrainer run folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from compute.sparsity.diff import Checkpoint, diff_checkpoints, lower_precision
from compute.sparsity.masks import n_keep, topk_mask
from compute.sparsity.overlap import score_vs_target
from compute.sparsity.series import (
    SeriesConfig,
    bf16_round_threshold,
    checkpoint_series,
    find_checkpoints,
    write_series,
)

NAMES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
         "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight",
         "model.layers.1.mlp.up_proj.weight", "model.norm.weight")


def _save(folder: Path, sd: dict[str, torch.Tensor], shards: int = 1, state: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    sd = {n: t.contiguous() for n, t in sd.items()}
    if shards == 1:
        save_file(sd, str(folder / "model.safetensors"))
    else:
        names = sorted(sd)
        weight_map = {}
        for i in range(shards):
            part = names[i::shards]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: sd[n] for n in part}, str(folder / fname))
            weight_map.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    if state is not None:
        (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def _random_run(tmp: Path, base_dtype: torch.dtype, ck_dtype: torch.dtype, steps=(2, 4, 10),
                sharded_step: int | None = 4) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A base and a run folder whose checkpoints each move a random subset of coordinates by
    sizes spread around the tolerances (some below 1e-5, some below half a bf16 ULP)."""
    g = torch.Generator().manual_seed(1)
    shapes = {NAMES[0]: (40, 16), NAMES[1]: (16, 16), NAMES[2]: (32, 16), NAMES[3]: (16, 16),
              NAMES[4]: (32, 16), NAMES[5]: (16,)}
    w = {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}
    base = _save(tmp / "base", {n: t.to(base_dtype) for n, t in w.items()})
    run = tmp / "run"
    cur = {n: t.to(base_dtype).float() for n, t in w.items()}
    for step in steps:
        for n in cur:
            moved = torch.rand(cur[n].shape, generator=g) < 0.3
            size = 10 ** (-3 - 4 * torch.rand(cur[n].shape, generator=g))  # 1e-7 .. 1e-3
            sign = torch.where(torch.rand(cur[n].shape, generator=g) < 0.5, -1.0, 1.0)
            cur[n] = cur[n] + moved * size * sign
        _save(run / f"checkpoint-{step}", {n: t.to(ck_dtype) for n, t in cur.items()},
              shards=2 if step == sharded_step else 1,
              state={"global_step": step, "log_history": [{"step": step, "loss": 0.5 / step, "reward": 0.1 * step}]})
        cur = {n: t.to(ck_dtype).float() for n, t in cur.items()}
    fisher = {n: torch.rand(s, generator=g) ** 3 for n, s in shapes.items()}
    fisher[NAMES[5]] = torch.zeros(shapes[NAMES[5]])  # ties at zero
    return base, run, fisher


# ---------------------------------------------------------------------------------------------
# Hand values
# ---------------------------------------------------------------------------------------------


def test_hand_values_fp32(tmp_path: Path) -> None:
    base = torch.zeros(10)
    c1 = base.clone()
    c1[0], c1[1], c1[2] = 1e-3, -2e-3, 1e-6  # two above atol 1e-5, one below
    c2 = c1.clone()
    c2[3] = 5e-4
    _save(tmp_path / "base", {"model.layers.0.mlp.up_proj.weight": base})
    _save(tmp_path / "run" / "checkpoint-5", {"model.layers.0.mlp.up_proj.weight": c1})
    _save(tmp_path / "run" / "checkpoint-10", {"model.layers.0.mlp.up_proj.weight": c2})
    fisher = {"model.layers.0.mlp.up_proj.weight": torch.tensor([9.0, 0, 0, 8, 0, 0, 0, 0, 0, 0])}
    res = checkpoint_series(tmp_path / "base", tmp_path / "run", fisher=fisher,
                            config=SeriesConfig(support_percent=20.0))
    assert [p["step"] for p in res.points] == [5, 10]
    p1, p2 = res.points
    g1b, g2b, g2p = (p1["vs_base"]["global"]["all"], p2["vs_base"]["global"]["all"],
                     p2["vs_prev"]["global"]["all"])
    assert g1b["update_sparsity"] == 0.7 and g1b["unchanged_atol_1e-05"] == 0.8
    assert g2b["update_sparsity"] == 0.6 and g2b["changed"] == 4
    assert g2p["update_sparsity"] == 0.9 and g2p["changed"] == 1
    assert p1["vs_prev"]["global"]["all"] == g1b  # the first step's previous is the base
    # bf16 delta: bf16(1e-6) = 9.98e-7 <= 1e-5, bf16(+-1e-3) > 1e-5
    assert g1b["unchanged_bf16delta_atol_1e-05"] == 0.8
    # sync of step 10: 1 changed coordinate x (int32 index + float32 value); support = top 2 Fisher
    assert g2p["dense_bytes"] == 40 and g2p["sparse_bytes"] == 8
    assert g2p["support_size"] == 2 and g2p["support_bytes"] == 8
    assert g2p["support_changed"] == 1 and g2p["captured_count_share"] == 1.0
    assert g2p["captured_sq_share"] == pytest.approx(1.0)
    assert g2p["precision_at_k"] == 0.5
    # step 5: changed {0, 1, 2}; support {0, 3} captures 1 of 3 by count, 1e-6 / (1e-6 + 4e-6 + 1e-12)
    assert g1b["captured_count_share"] == pytest.approx(1 / 3)
    assert g1b["captured_sq_share"] == pytest.approx(1e-6 / (1e-6 + 4e-6 + 1e-12), rel=1e-6)
    # AUC of the Fisher for "changed" at step 10 (only coordinate 3 changed; it has rank 9 of 10,
    # the negatives' ranks: 10 (the 9.0) and eight zeros tied at 4.5): (9 - 1) / 9
    assert g2p["auc"] == pytest.approx(8 / 9)
    assert "trainer" not in p2  # no trainer_state.json


def test_published_convention_compares_in_bf16(tmp_path: Path) -> None:
    """|delta_bf16| <= atol as PyTorch (and compute.sparsity.diff) evaluates it on bf16 tensors: atol is
    rounded to bf16 too, so a delta of exactly bf16(1e-5) = 1.00136e-5 counts as unchanged there,
    and as changed in the float32 convention."""
    a16 = torch.tensor([1e-5]).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        base = torch.zeros(4, dtype=dtype)
        cur = torch.stack([a16[0].float(), torch.tensor(2e-5), torch.tensor(9e-6), torch.tensor(0.0)]).to(dtype)
        _save(tmp_path / str(dtype) / "base", {"model.norm.weight": base})
        _save(tmp_path / str(dtype) / "run" / "checkpoint-1", {"model.norm.weight": cur})
        res = checkpoint_series(tmp_path / str(dtype) / "base", tmp_path / str(dtype) / "run")
        g = res.points[0]["vs_base"]["global"]["all"]
        want = diff_checkpoints({"model.norm.weight": base}, {"model.norm.weight": cur}, svd_max_numel=0)
        assert g["unchanged_bf16delta_atol_1e-05"] == 0.75 == want.groups["global"]["all"]["unchanged_bf16delta_atol_1e-05"]
        assert g["unchanged_atol_1e-05"] == 0.5 == want.groups["global"]["all"]["unchanged_atol_1e-05"]


def test_bf16_round_threshold_matches_torch_rounding() -> None:
    for atol in (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 0.5, 1.0, 3e-5):
        t, inclusive = bf16_round_threshold(atol)
        near = torch.tensor(t, dtype=torch.float32)
        xs = [near]
        for direction in (math.inf, -math.inf):
            x = near
            for _ in range(40):
                x = torch.nextafter(x, torch.tensor(direction))
                xs.append(x)
        xs_t = torch.stack(xs)
        xs_t = torch.cat([xs_t, torch.linspace(0, 3 * atol, 20001)])
        want = xs_t.to(torch.bfloat16) <= atol  # PyTorch compares in bf16, atol rounded to bf16
        got = xs_t <= t if inclusive else xs_t < t
        assert torch.equal(got, want), atol


# ---------------------------------------------------------------------------------------------
# Brute force: compute.sparsity.diff on each pair, compute.sparsity.overlap for the Fisher
# ---------------------------------------------------------------------------------------------


DIFF_KEYS = ("unchanged_exact", "unchanged_bf16", "unchanged_atol_1e-05", "unchanged_bf16delta_atol_1e-05",
             "delta_rms", "max_abs_delta", "numel")


@pytest.mark.parametrize(("base_dtype", "ck_dtype", "cap"), [
    (torch.float32, torch.float32, 1000), (torch.bfloat16, torch.bfloat16, 2_000_000),
    (torch.float32, torch.bfloat16, 2_000_000), (torch.bfloat16, torch.float32, 1000)])
def test_against_diff_and_overlap(tmp_path: Path, base_dtype: torch.dtype, ck_dtype: torch.dtype, cap: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if cap == 1000:  # the numpy sweep (not the C kernel), in chunks of 37 elements (ragged last chunk)
        monkeypatch.setattr("compute.sparsity.series.CHUNK", 37)
        monkeypatch.setenv("FISHERLENS_SERIES_KERNEL", "0")
    base, run, fisher = _random_run(tmp_path, base_dtype, ck_dtype)
    frac = 0.05
    res = checkpoint_series(base, run, fisher=fisher, config=SeriesConfig(support_percent=100 * frac, auc_cap=cap))
    assert [p["step"] for p in res.points] == [2, 4, 10]
    folders = [base] + [run / f"checkpoint-{s}" for s in (2, 4, 10)]
    support = topk_mask(fisher, n_keep(frac, sum(f.numel() for f in fisher.values())))
    assert res.settings["fisher"]["auc_sampled"] == (cap == 1000)
    for i, point in enumerate(res.points):
        cur = Checkpoint(folders[i + 1])
        for pair, ref_folder in (("vs_base", base), ("vs_prev", folders[i])):
            ref = Checkpoint(ref_folder)
            want = diff_checkpoints(ref, cur, svd_max_numel=0)
            # issue 27: "changed", the Fisher's share and the sync bytes in the lower of the two
            # stored precisions (both cast there), exact equality only when stored alike
            low = lower_precision(cur.get(NAMES[0]).dtype, ref.get(NAMES[0]).dtype)
            deltas = {n: cur.get(n).to(low).float() - ref.get(n).to(low).float() for n in cur.names()}
            changed = {n: d != 0 for n, d in deltas.items()}
            ov = score_vs_target(fisher, {n: d.abs() for n, d in deltas.items()}, frac, cap=cap,
                                 target_set=changed)
            item = torch.empty((), dtype=low).element_size()
            for grouping in ("global", "layer", "module", "layer_module"):
                assert set(point[pair][grouping]) == set(want.groups[grouping])
                for g, got in point[pair][grouping].items():
                    exp = want.groups[grouping][g]
                    for k in DIFF_KEYS:
                        assert got[k] == pytest.approx(exp[k], rel=1e-6, abs=1e-12), (pair, grouping, g, k)
                    assert got["update_sparsity"] == exp["unchanged_common"] == got["unchanged_common"]
                    o = ov[grouping][g]
                    assert got["support_size"] == o["n_a"] and got["support_changed"] == o["overlap"]
                    assert got["precision_at_k"] == pytest.approx(o["precision_at_k"], nan_ok=True), (pair, grouping, g)
                    if o["n_b"]:
                        assert got["captured_count_share"] == pytest.approx(o["overlap_frac_b"], nan_ok=True)
                    assert got["auc"] == pytest.approx(o["auc"], nan_ok=True), (pair, grouping, g)
                    members = [n for n in deltas if _in_group(n, grouping, g)]
                    sq = sum(float(deltas[n].double().square().sum()) for n in members)
                    sq_s = sum(float(deltas[n][support[n]].double().square().sum()) for n in members)
                    if sq > 0:
                        assert got["captured_sq_share"] == pytest.approx(sq_s / sq, rel=1e-5)
                    n_ch = sum(int(changed[n].sum()) for n in members)
                    numel = sum(deltas[n].numel() for n in members)
                    assert got["sparse_bytes"] == n_ch * (4 + item)
                    assert got["dense_bytes"] == numel * cur.get(NAMES[0]).element_size()
                    assert got["support_bytes"] == o["n_a"] * item
        assert point["trainer"]["log"] == {"loss": pytest.approx(0.5 / point["step"]),
                                           "reward": pytest.approx(0.1 * point["step"])}
        assert point["trainer"]["global_step"] == point["step"]


def _in_group(name: str, grouping: str, group: str) -> bool:
    from compute.sparsity.masks import group_key

    return group_key(name, grouping) == group


def test_write_series_json(tmp_path: Path) -> None:
    base, run, fisher = _random_run(tmp_path, torch.bfloat16, torch.bfloat16, steps=(1, 2))
    res = checkpoint_series(base, run, fisher=fisher)
    path = write_series(res, tmp_path / "out")
    data = json.loads(path.read_text())
    assert data["steps"] == [1, 2]
    assert [p["step"] for p in data["points"]] == [1, 2]
    g = data["points"][1]["vs_prev"]["layer_module"]["0/q"]
    assert 0 <= g["update_sparsity"] <= 1 and g["auc"] is None or 0 <= g["auc"] <= 1


def test_without_fisher_has_no_support_fields(tmp_path: Path) -> None:
    base, run, _ = _random_run(tmp_path, torch.float32, torch.float32, steps=(3,))
    res = checkpoint_series(base, run)
    g = res.points[0]["vs_prev"]["global"]["all"]
    assert "support_bytes" not in g and "auc" not in g and "fisher" not in res.settings


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def test_refuses_odd_run_folders(tmp_path: Path) -> None:
    sd = {"model.layers.0.mlp.up_proj.weight": torch.zeros(4)}
    base = _save(tmp_path / "base", sd)
    with pytest.raises(ValueError, match=r"run_dir: .* is not a directory"):
        find_checkpoints(tmp_path / "nope")
    empty = tmp_path / "empty"
    (empty / "logs").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"run_dir: no checkpoint-<step> folder in .*it holds: logs"):
        checkpoint_series(base, empty)
    odd = tmp_path / "odd"
    _save(odd / "checkpoint-1", sd)
    (odd / "checkpoint-final").mkdir()
    with pytest.raises(ValueError, match=r"'checkpoint-final' .* is not a checkpoint-<step> folder"):
        checkpoint_series(base, odd)
    dup = tmp_path / "dup"
    _save(dup / "checkpoint-1", sd)
    _save(dup / "checkpoint-01", sd)
    with pytest.raises(ValueError, match=r"both step 1"):
        checkpoint_series(base, dup)
    afile = tmp_path / "afile"
    _save(afile / "checkpoint-1", sd)
    (afile / "checkpoint-2").write_text("x")
    with pytest.raises(ValueError, match=r"checkpoint-2 .* is a file"):
        checkpoint_series(base, afile)
    noweights = tmp_path / "noweights"
    (noweights / "checkpoint-3").mkdir(parents=True)
    (noweights / "checkpoint-3" / "pytorch_model.bin").write_text("x")
    with pytest.raises(ValueError, match=r"run_dir: checkpoint-3: no safetensors weights"):
        checkpoint_series(base, noweights)
    shard = tmp_path / "shard"
    _save(shard / "checkpoint-1", {**sd, "model.norm.weight": torch.ones(2)}, shards=2)
    (shard / "checkpoint-1" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"run_dir: checkpoint-1: shard model-00002-of-00002.safetensors .* missing"):
        checkpoint_series(base, shard)


def test_refuses_checkpoints_that_do_not_fit_the_base(tmp_path: Path) -> None:
    sd = {"model.layers.0.mlp.up_proj.weight": torch.zeros(4), "model.norm.weight": torch.ones(2)}
    base = _save(tmp_path / "base", sd)
    run = tmp_path / "run"
    _save(run / "checkpoint-1", sd)
    _save(run / "checkpoint-2", {**sd, "model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"run_dir: checkpoint-2: parameter 'model.norm.weight' has shape \[3\] "
                                         r"but \[2\] in the base"):
        checkpoint_series(base, run)
    run2 = tmp_path / "run2"
    _save(run2 / "checkpoint-1", {"model.layers.0.mlp.up_proj.weight": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"checkpoint-1: parameter 'model.norm.weight' is in the base but not"):
        checkpoint_series(base, run2)
    run3 = tmp_path / "run3"
    _save(run3 / "checkpoint-1", {**sd, "lm_head.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"checkpoint-1: parameter 'lm_head.weight' is in this checkpoint but not"):
        checkpoint_series(base, run3)
    good = tmp_path / "good"
    _save(good / "checkpoint-1", sd)
    with pytest.raises(ValueError, match=r"fisher: parameter 'model.norm.weight' has shape \[5\] but \[2\]"):
        checkpoint_series(base, good, fisher={"model.norm.weight": torch.ones(5)})
    with pytest.raises(ValueError, match=r"fisher: parameter 'x' is not in the base"):
        checkpoint_series(base, good, fisher={"x": torch.ones(5)})
    with pytest.raises(ValueError, match=r"support_percent: got 0"):
        SeriesConfig(support_percent=0)
    with pytest.raises(ValueError, match=r"atol: got -1"):
        SeriesConfig(atol=-1)


# ---------------------------------------------------------------------------------------------
# A real TRL run folder
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_trl_grpo_run_folder(zoo_home: Path, tmp_path: Path, dtype: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPOTrainer (TRL) with save_steps=1 for 3 steps on arith-base; the series of its folder
    against the base, with a real Fisher of the base, equals compute.sparsity.diff on every pair."""
    from compute.fisher import FisherConfig, estimate_fisher
    from compute.lm.causal_lm import load_model
    from compute.lm.verifiable_tasks import get_task
    from tests.trl_runs import grpo_run_folder

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    base_dir = zoo_home / "zoo" / "arith-base"
    run = grpo_run_folder(base_dir, tmp_path / "run", steps=3, dtype=dtype)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert (run / "checkpoint-2" / "optimizer.pt").is_file()
    model, tok = load_model("arith-base", device="cpu")
    fisher = estimate_fisher(model, tok, get_task("arithmetic"),
                             FisherConfig(prompts=8, samples=2, max_new_tokens=6, device="cpu")).fisher
    fisher = {n: f.float() for n, f in fisher.items()}
    res = checkpoint_series(base_dir, run, fisher=fisher)
    assert [p["step"] for p in res.points] == [1, 2, 3]
    item = 4 if dtype == "float32" else 2
    for i, p in enumerate(res.points):
        assert p["dtype"] == dtype
        assert p["trainer"]["global_step"] == p["step"] and "loss" in p["trainer"]["log"]
        cur = Checkpoint(run / f"checkpoint-{p['step']}")
        prev = Checkpoint(run / f"checkpoint-{p['step'] - 1}") if i else Checkpoint(base_dir)
        for pair, ref in (("vs_base", Checkpoint(base_dir)), ("vs_prev", prev)):
            want = diff_checkpoints(ref, cur, svd_max_numel=0).groups["layer_module"]
            for g, got in p[pair]["layer_module"].items():
                for k in DIFF_KEYS:
                    assert got[k] == pytest.approx(want[g][k], rel=1e-6, abs=1e-12), (p["step"], pair, g, k)
        g = p["vs_prev"]["global"]["all"]
        assert g["sparse_bytes"] == g["changed"] * (4 + item)
        assert g["support_bytes"] == g["support_size"] * item
    assert res.points[0]["vs_base"]["global"]["all"]["changed"] > 0  # the first step moved weights
    # the first step's previous is the base (json: NaN AUCs compare equal)
    assert json.dumps(res.points[0]["vs_prev"]) == json.dumps(res.points[0]["vs_base"])
    assert res.settings["fisher"]["k"] == n_keep(0.01, sum(f.numel() for f in fisher.values()))


# ---------------------------------------------------------------------------------------------
# fisherlens train --save-steps writes the same layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_save_steps_writes_a_run_folder(zoo_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--save-steps 2 over 3 steps: checkpoint-2 and checkpoint-3 (the last), the weights in the
    stored dtype (bf16 for bf16-mixed), checkpoint-3 bit-identical to the final model, and the
    series of the output folder reads them like a TRL run folder."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from app.commands.training import train_cmd

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    out = tmp_path / "run"
    res = CliRunner().invoke(train_cmd, [
        "--model", "arith-base", "--steps", "3", "--save-steps", "2", "--batch", "2", "--group", "4",
        "--eval-prompts", "4", "--max-new-tokens", "4", "--no-bound", "--no-concentration",
        "--precision", "bf16-mixed", "--lr", "1e-3", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert not list(out.glob("tmp-checkpoint-*"))
    final = load_file(str(out / "model.safetensors"))
    last = load_file(str(out / "checkpoint-3" / "model.safetensors"))
    assert set(final) == set(last)
    for n in final:
        assert last[n].dtype == torch.bfloat16 and torch.equal(last[n], final[n]), n
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and [r["step"] for r in state["log_history"]] == [1, 2]
    assert (out / "checkpoint-2" / "config.json").is_file() and (out / "checkpoint-2" / "tokenizer.json").is_file()
    series = checkpoint_series(zoo_home / "zoo" / "arith-base", out)
    assert [p["step"] for p in series.points] == [2, 3]
    assert series.points[1]["prev_step"] == 2
    want = diff_checkpoints(Checkpoint(zoo_home / "zoo" / "arith-base"), Checkpoint(out), svd_max_numel=0)
    got = series.points[1]["vs_base"]["global"]["all"]
    for k in DIFF_KEYS:
        assert got[k] == pytest.approx(want.groups["global"]["all"][k], rel=1e-6, abs=1e-12), k
