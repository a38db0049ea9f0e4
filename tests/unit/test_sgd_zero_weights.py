"""Issue 27, item 6: why bf16-mixed SGD changed ~0.242% of SmolLM2-135M's stored bf16 weights at
every lr from 1e-6 to 1e-4. The sweep's own |w| bins (benchmarks/results/real_smollm2/sweep.json,
fisher_auc_changed_by_binade) place every one of those changes (325,128 at lr 1e-6) in the w == 0
bin, which holds exactly 325,128 weights: every weight that is exactly 0 in the base changed, and
nothing else. A weight at 0 has no rounding slack (its bf16 neighbours are subnormals), so any
nonzero update however small shows in the stored bf16 value; the count is the number of zeros, not
a function of lr. Not a defect of the training code: reproduced here on a zoo model whose base has
zeros planted, with the counts the diff reports (zero_in_base, changed_from_zero)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compute.sparsity.diff import Checkpoint, diff_checkpoints


def test_the_smollm2_sgd_changes_are_its_exact_zeros() -> None:
    """The committed SmolLM2 sweep: at every SGD lr the w == 0 bin holds all the changed weights
    at lr 1e-6 and 1e-5 (up to a few dozen at 1e-4), and every weight of that bin changed."""
    d = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/real_smollm2/sweep.json").read_text())
    sgd = [p for p in d["points"] if p["optimizer"] == "sgd"]
    assert [p["lr"] for p in sgd] == [1e-6, 1e-5, 1e-4]
    for p in sgd:
        bins = p["fisher_auc_changed_by_binade"]
        zero = next(b for b in bins if b["exponent"] == -1000)
        changed = sum(b["n_changed"] for b in bins)
        n = sum(b["n"] for b in bins)
        assert zero["n_changed"] == zero["n"] == 325_128  # every exact zero changed
        assert changed - zero["n_changed"] <= 500  # nonzero weights: 0, 19 and 480 of them
        assert 1 - p["unchanged_exact"] == pytest.approx(changed / n, rel=1e-6)


@pytest.mark.parametrize("lr", [1e-9, 1e-6])
def test_bf16_mixed_sgd_moves_the_exact_zeros_of_the_base_at_any_lr(zoo_home: Path, tmp_path: Path, lr: float,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """arith-base with 1% of each matrix set to exactly 0: bf16-mixed SGD for one step at a tiny
    lr changes (in the stored bf16 checkpoint) exactly those zeros whose gradient is nonzero and
    no other weight; the diff reports them as changed_from_zero."""
    from compute.jobs import train_run
    from compute.jobs.train import TrainSpec

    src = zoo_home / "zoo" / "arith-base"
    model = tmp_path / "zeros"
    model.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (model / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for t in sd.values():
        if t.dim() == 2:
            t[torch.rand(t.shape, generator=g) < 0.01] = 0.0
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(tmp_path))
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    monkeypatch.setenv("FISHERLENS_DEVICE", "cpu")
    res = train_run.run(TrainSpec(model=str(model), optimizer="sgd", lr=lr, precision="bf16-mixed", steps=1,
                                  batch=4, group=4, max_new_tokens=4, eval_prompts=4, device="cpu",
                                  concentration=True, bound=False, fisher_prompts=2, fisher_samples=2))
    tuned = Checkpoint(res.files["model"])
    base = Checkpoint(model)
    gsq = res.tensors["grad_sq_sum"]  # sum of g^2 over the run's one update
    moved_zero = moved_other = zero_with_grad = 0
    for n in base.names():
        b, t = base.get(n), tuned.get(n)
        changed = b.bfloat16() != t
        zero = b == 0
        moved_zero += int((changed & zero).sum())
        moved_other += int((changed & ~zero).sum())
        zero_with_grad += int((zero & (gsq[n] > 0)).sum()) if n in gsq else 0
    assert moved_other == 0, moved_other  # the step is far below half a bf16 ULP of every nonzero weight
    assert moved_zero == zero_with_grad > 500  # every zero that got a gradient moved off 0
    s = diff_checkpoints(base, tuned, svd_max_numel=0).groups["global"]["all"]
    assert s["changed_from_zero"] * s["numel"] == pytest.approx(moved_zero)
    assert 1 - s["unchanged_common"] == pytest.approx(s["changed_from_zero"])
    us = res.summary["update_sparsity"]
    assert us["changed_from_zero"] == pytest.approx(s["changed_from_zero"])
    assert os.path.isfile(Path(res.files["model"]) / "model.safetensors")
