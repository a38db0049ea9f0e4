"""Masked training: frozen coordinates stay bit-identical (AdamW with weight decay, SGD with
momentum and weight decay), trainable ones move, the optimizer matches torch's on the mask, and
the GRPO / OPD / SFT loops run end to end on a tiny random model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from compute.lm.verifiable_tasks import get_task
from compute.train import (
    MaskedOptimizer,
    TrainConfig,
    clip_grad_norm,
    grads_of,
    mask_gradients,
    prepare_masked_params,
    train,
)
from tests.unit.fisher_tiny import ParityTask, char_tokenizer, tiny_model


def _lm_loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 16, (4, 6), generator=g)
    return model(input_ids=ids, labels=ids).loss


def _random_mask(model: torch.nn.Module, density: float = 0.3, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = {n: torch.rand(p.shape, generator=g) < density for n, p in model.named_parameters()}
    names = list(mask)
    mask[names[0]] = torch.zeros_like(mask[names[0]])  # one tensor fully frozen
    mask[names[1]] = torch.ones_like(mask[names[1]])  # one fully trainable
    return mask


def _run_steps(model, mask, kind: str, steps: int = 4, **kw) -> MaskedOptimizer:
    params = prepare_masked_params(model, mask)
    opt = MaskedOptimizer(params, kind, **kw)
    for s in range(steps):
        opt.zero_grad()
        _lm_loss(model, s).backward()
        mask_gradients(params)
        clip_grad_norm(params, 1.0)
        opt.step()
    return opt


@pytest.mark.parametrize(
    "kind,kw",
    [("adamw", {"lr": 1e-2, "weight_decay": 0.5}),
     ("sgd", {"lr": 0.5, "weight_decay": 0.5, "momentum": 0.9})],
)
def test_masked_out_weights_bit_identical_and_masked_in_move(kind: str, kw: dict) -> None:
    model = tiny_model("qwen3")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    mask = _random_mask(model)
    opt = _run_steps(model, mask, kind, **kw)
    names = list(mask)
    assert not dict(model.named_parameters())[names[0]].requires_grad  # fully frozen: no grad at all
    for n, p in model.named_parameters():
        m = mask[n]
        assert torch.equal(p.detach()[~m], start[n][~m]), f"{n}: a frozen coordinate changed"
        if m.any():
            moved = (p.detach()[m] != start[n][m]).float().mean()
            assert moved > 0.9, f"{n}: only {moved:.2f} of trainable coordinates moved"
        for buf in opt.state.get(n, {}).values():  # state only at the mask's coordinates
            assert buf.numel() == int(m.sum()), f"{n}: optimizer state of {buf.numel()} coordinates"
        assert p.grad is None or bool(m.all()), f"{n}: a dense gradient outlived the backward"


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_without_mask_every_weight_moves(kind: str) -> None:
    model = tiny_model("qwen3")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _run_steps(model, None, kind, lr=1e-2, weight_decay=0.1, momentum=0.9 if kind == "sgd" else 0.0)
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), start[n]), f"{n} did not move in full training"


def test_torch_adamw_would_shrink_frozen_weights() -> None:
    """Why we need our own step: torch's AdamW decays every coordinate, even with zero gradient."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.5)
    w.grad = torch.zeros(3)
    opt.step()
    assert not torch.equal(w.detach(), torch.ones(3))


@pytest.mark.parametrize(
    "kind,ours,theirs",
    [("adamw", {"lr": 1e-2, "weight_decay": 0.1}, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
     ("sgd", {"lr": 0.1, "weight_decay": 0.1, "momentum": 0.9},
      lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1, momentum=0.9))],
)
def test_dense_step_matches_torch(kind: str, ours: dict, theirs) -> None:
    a = tiny_model("qwen3")
    b = copy.deepcopy(a)
    params = prepare_masked_params(a, None)
    opt_a = MaskedOptimizer(params, kind, **ours)
    opt_b = theirs(list(b.parameters()))
    for s in range(3):
        opt_a.zero_grad()
        opt_b.zero_grad()
        _lm_loss(a, s).backward()
        _lm_loss(b, s).backward()
        opt_a.step()
        opt_b.step()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_mask_validation() -> None:
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="^mask: parameter 'nope'"):
        prepare_masked_params(model, {"nope": torch.ones(2, dtype=torch.bool)})
    n, p = next(iter(model.named_parameters()))
    with pytest.raises(ValueError, match="^mask: parameter .* has shape"):
        prepare_masked_params(model, {n: torch.ones(p.numel() + 1, dtype=torch.bool)})
    with pytest.raises(ValueError, match="selects no coordinate"):
        prepare_masked_params(model, {n: torch.zeros_like(p, dtype=torch.bool)})


def test_train_config_validation() -> None:
    with pytest.raises(ValueError, match="^algo:"):
        TrainConfig(algo="ppo")
    with pytest.raises(ValueError, match="^group:"):
        TrainConfig(algo="grpo", group=1)
    with pytest.raises(ValueError, match="^optimizer:"):
        TrainConfig(optimizer="adam")


def test_train_config_takes_defaults_and_ranges_from_the_spec() -> None:
    from dataclasses import fields

    from compute.jobs.retention import RetentionSpec
    from compute.jobs.train import TrainSpec

    spec = TrainSpec(model="arith-base")
    cfg = TrainConfig()
    shared = [f.name for f in fields(TrainConfig) if f.name in TrainSpec.model_fields]
    assert len(shared) >= 15 and all(getattr(cfg, n) == getattr(spec, n) for n in shared)
    assert cfg.lr == 2e-4 and cfg.clip_eps == 0.2  # one default, the spec's
    with pytest.raises(ValueError, match=r"^lr: got 11.0; accepted range: > 0.0, <= 10.0"):
        TrainConfig(lr=11.0)
    tuned = TrainSpec(model="arith-base", lr=1e-3, clip_eps=0.3, sft_source="self", precision="bf16-mixed")
    c = TrainConfig.from_spec(tuned, steps=3)
    assert (c.lr, c.clip_eps, c.sft_source, c.precision, c.steps) == (1e-3, 0.3, "self", "bf16-mixed", 3)
    # a spec without a precision field whose weights load in bf16 trains them in bf16
    r = TrainConfig.from_spec(RetentionSpec(dtype="bfloat16", steps=7))
    assert r.precision == "bf16" and r.steps == 7 and r.batch == 16


def test_requires_grad_restored_when_training_fails() -> None:
    model = tiny_model("qwen3")
    names = [n for n, _ in model.named_parameters()]
    model.get_parameter(names[1]).requires_grad_(False)  # the mask trains it: True during training

    class Boom:
        def examples(self, *a, **k):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(model, char_tokenizer(), Boom(), _cfg("sft"), mask=_random_mask(model, 0.5), evaluate=False)
    # names[0] was frozen by the mask (all False), names[1] unfrozen: both back as they were
    assert [p.requires_grad for p in model.parameters()] == [n != names[1] for n in names]


def _cfg(algo: str, **kw) -> TrainConfig:
    base = dict(algo=algo, steps=2, batch=2, group=3, max_new_tokens=4, eval_prompts=4,
                lr=1e-2, weight_decay=0.1, eval_max_new_tokens=4)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("algo,extra", [("grpo", {"kl_coef": 0.1, "inner_steps": 2}),
                                        ("opd", {}), ("opd", {"distill_estimator": "sampled"}),
                                        ("sft", {}), ("sft", {"sft_source": "self"})])
def test_train_loop_masked_runs_and_freezes(algo: str, extra: dict) -> None:
    tok = char_tokenizer()
    task = get_task("arithmetic-add?digits=1")
    model = tiny_model("qwen3")
    teacher = tiny_model("qwen3", seed=1) if algo == "opd" else None
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    mask = _random_mask(model, 0.5)
    seen = []
    res = train(model, tok, task, _cfg(algo, **extra), mask=mask, teacher=teacher, teacher_tokenizer=tok,
                progress=lambda f, m="": seen.append(f))
    assert seen[-1] == 1.0 and len(res.curve) == 2
    assert 0 <= res.accuracy_before <= 1 and 0 <= res.accuracy_after <= 1
    for n, p in model.named_parameters():
        assert torch.equal(p.detach()[~mask[n]], start[n][~mask[n]]), n
        assert p.requires_grad  # restored after training
    if algo == "sft" and extra.get("sft_source") == "self":
        return  # a random model rarely gets a reward: nothing may have been kept
    assert any(not torch.equal(p.detach(), start[n]) for n, p in model.named_parameters())


def test_grpo_same_seed_same_result() -> None:
    tok = char_tokenizer()
    task = get_task("arithmetic-add?digits=1")
    a, b = tiny_model("qwen3"), tiny_model("qwen3")
    ra = train(a, tok, task, _cfg("grpo"), evaluate=False)
    rb = train(b, tok, task, _cfg("grpo"), evaluate=False)
    assert ra.curve == rb.curve
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("algo,masked", [("grpo", True), ("sft", False)])
def test_gradient_checkpointing_trains_the_same_weights(algo: str, masked: bool) -> None:
    """gradient_checkpointing recomputes each layer's activations in backward: the run reaches the
    same weights as without it (float tolerance; the masked layers' folds run once, in the
    recomputed backward), frozen coordinates stay bit-identical, the layers did recompute (the
    forward of a layer runs again during backward), and the model has it off again afterwards."""
    tok = char_tokenizer()
    task = get_task("arithmetic-add?digits=1")
    plain, ckpt = tiny_model("qwen3", seed=3), tiny_model("qwen3", seed=3)
    start = {n: p.detach().clone() for n, p in plain.named_parameters()}
    mask = _random_mask(plain, 0.5) if masked else None
    train(plain, tok, task, _cfg(algo), mask=mask, evaluate=False)
    train(ckpt, tok, task, _cfg(algo, gradient_checkpointing=True), mask=mask, evaluate=False)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in ckpt.modules())
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert_close(q, p, atol=1e-5, rtol=1e-4, msg=n)
        if mask is not None:
            assert torch.equal(q.detach()[~mask[n]], start[n][~mask[n]]), n
    assert any(not torch.equal(p.detach(), start[n]) for n, p in ckpt.named_parameters())
    # count a module's forward inside the layer: checkpointing's recompute runs forward, not hooks
    def count(model: torch.nn.Module, calls: list[int]) -> None:
        mlp = model.model.layers[0].mlp
        forward = mlp.forward
        mlp.forward = lambda *a, **k: (calls.append(1), forward(*a, **k))[1]
    plain_calls: list[int] = []
    ckpt_calls: list[int] = []
    count(plain, plain_calls)
    count(ckpt, ckpt_calls)
    train(plain, tok, task, _cfg(algo, steps=1), mask=mask, evaluate=False)
    train(ckpt, tok, task, _cfg(algo, steps=1, gradient_checkpointing=True), mask=mask, evaluate=False)
    assert len(ckpt_calls) > len(plain_calls)  # the recomputed forwards


def test_opd_needs_teacher() -> None:
    with pytest.raises(ValueError, match="^teacher:"):
        train(tiny_model("qwen3"), char_tokenizer(), get_task("arithmetic"), _cfg("opd"))


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,flag",
    [(["--model", "arith-base", "--lr", "-1"], "--lr"),
     (["--model", "arith-base", "--algo", "ppo"], "--algo"),
     (["--model", "arith-base", "--group", "1"], "--group"),
     (["--model", "no-such-model-xyz"], "model"),
     (["--model", "arith-base", "--precision", "fp8"], "--precision"),
     (["--model", "arith-base", "--precision", "bf16", "--dtype", "float32"], "--dtype")],
)
def test_train_cli_bad_values_exit_2_with_one_line(args: list[str], flag: str, tmp_path, fl_home) -> None:
    from click.testing import CliRunner

    from app.commands.training import train_cmd

    res = CliRunner().invoke(train_cmd, [*args, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], res.output


def test_retention_cli_bad_values_exit_2(tmp_path, fl_home) -> None:
    from click.testing import CliRunner

    from app.commands.experiments import retention_cmd

    for args, flag in ((["--densities", "0.1,abc"], "--densities"), (["--densities", "0,0.1"], "--densities"),
                       (["--selectors", "fisher,best"], "--selectors"), (["--seeds", "0"], "--seeds")):
        res = CliRunner().invoke(retention_cmd, [*args, "--out", str(tmp_path)])
        assert res.exit_code == 2, res.output
        assert flag in res.output and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "opd", "sft"])
def test_train_cli_on_zoo_masked_run(algo: str, zoo_home, tmp_path, monkeypatch) -> None:
    import json

    from click.testing import CliRunner
    from safetensors.torch import load_file

    from app.commands.training import train_cmd

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    out = tmp_path / "run"
    args = ["--model", "arith-base", "--algo", algo, "--steps", "2", "--batch", "2", "--group", "2",
            "--eval-prompts", "10", "--max-new-tokens", "4", "--mask-select", "magnitude",
            "--mask-density", "0.1", "--weight-decay", "0.1", "--device", "cpu",
            "--fisher-prompts", "4", "--fisher-samples", "2", "--out", str(out)]
    if algo == "opd":
        args += ["--teacher", "arith-teacher"]
    res = CliRunner().invoke(train_cmd, args)
    assert res.exit_code == 0, res.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["curve"]) == 2 and metrics["settings"]["lr"] == metrics["spec"]["lr"] == 2e-4
    assert 0 <= metrics["accuracy_before"] <= 1 and 0 <= metrics["accuracy_after"] <= 1
    if algo == "grpo":
        b = metrics["bound"]
        assert b["identity_fraction_holds"] == 1.0  # same-sample identity: a self-check only
        assert b["bound_independent"] and b["bound_fisher"]["source"] == "other-prompts"
        assert 0 <= b["bound_violations"] <= b["bound_coordinates"] and b["bound_n_over_t"] > 0
    assert metrics["precision"] == "fp32"
    assert set(metrics["concentration"]) >= {"grad_sq_sum", "grad_abs_sum", "abs_delta"}
    assert (out / "grad_sq_sum.safetensors").is_file() and (out / "fisher.safetensors").is_file()
    base = load_file(str(zoo_home / "zoo" / "arith-base" / "model.safetensors"))
    tuned = load_file(str(out / "model.safetensors"))
    mask = load_file(str(out / "mask.safetensors"))
    moved = 0
    for n, m in mask.items():
        assert torch.equal(tuned[n][~m], base[n][~m]), n
        moved += int((tuned[n][m] != base[n][m]).sum())
    assert moved > 0
    assert metrics["update_sparsity"]["unchanged_exact"] >= 0.9


def test_objective_gradient_and_in_memory_masks_leave_the_model_unchanged() -> None:
    from compute.jobs.train_run import build_mask_in_memory
    from compute.train import objective_gradient

    tok, task = char_tokenizer(), get_task("arithmetic-add?digits=1")
    model = tiny_model("qwen3")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = _cfg("sft", steps=1)
    grads = objective_gradient(model, tok, task, cfg)
    assert set(grads) == set(start) and all(bool((g >= 0).all()) for g in grads.values())
    assert sum(float(g.sum()) for g in grads.values()) > 0
    for sel in ("gradient", "magnitude", "random"):
        mask, info = build_mask_in_memory(model, tok, task, sel, 0.1, 0, gradient_config=cfg)
        assert info["actual_density"] == pytest.approx(0.1, abs=1e-3)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), start[n])


# ---------------------------------------------------------------------------------------------
# Precision, gradient accumulation, the N/T constant
# ---------------------------------------------------------------------------------------------


def _sft_run(precision: str, lr: float, mask=None, steps: int = 3, optimizer: str = "adamw"):
    from compute.train import prepare_precision, stored_state

    tok, task = char_tokenizer(), get_task("arithmetic-add?digits=1")
    model = prepare_precision(tiny_model("qwen3"), precision)
    start_stored = stored_state(model, precision)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = _cfg("sft", steps=steps, lr=lr, weight_decay=0.0, precision=precision, optimizer=optimizer)
    train(model, tok, task, cfg, mask=mask, evaluate=False)
    return model, start, start_stored, stored_state(model, precision)


def _frac_identical(a: dict, b: dict) -> float:
    same = sum(int((a[n] == b[n]).sum()) for n in a)
    return same / sum(t.numel() for t in a.values())


def test_bf16_weights_lose_tiny_updates_fp32_keeps_them() -> None:
    # Adam moves each coordinate by ~lr per step; at lr 1e-6 that is far below half a bf16 ULP
    # of weights of size ~0.02 (~4e-5), so pure-bf16 weights stay bit-identical
    model, start, _, _ = _sft_run("bf16", 1e-6)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    now = {n: p.detach() for n, p in model.named_parameters()}
    assert _frac_identical(start, now) > 0.95
    model, start, _, _ = _sft_run("fp32", 1e-6)
    now = {n: p.detach() for n, p in model.named_parameters()}
    assert _frac_identical(start, now) < 0.5  # every coordinate with a gradient moved


def test_bf16_mixed_master_moves_but_stored_checkpoint_stays() -> None:
    model, start, start_stored, end_stored = _sft_run("bf16-mixed", 1e-6)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(t.dtype == torch.bfloat16 for t in end_stored.values())
    # the master weights start from the base rounded to bf16 (a published bf16 checkpoint)
    assert all(torch.equal(start[n].to(torch.bfloat16).float(), start[n]) for n in start)
    now = {n: p.detach() for n, p in model.named_parameters()}
    assert _frac_identical(start, now) < 0.5  # float32 master weights moved
    assert _frac_identical(start_stored, end_stored) > 0.95  # the bf16 checkpoint did not
    # a large learning rate changes the stored checkpoint too
    _, _, start_stored, end_stored = _sft_run("bf16-mixed", 1e-2)
    assert _frac_identical(start_stored, end_stored) < 0.5


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_masked_coordinates_bit_identical_in_every_precision(precision: str, optimizer: str) -> None:
    from compute.train import prepare_precision

    mask = _random_mask(prepare_precision(tiny_model("qwen3"), precision), 0.3)
    model, start, _, _ = _sft_run(precision, 5e-2 if optimizer == "adamw" else 5.0, mask=mask,
                                  optimizer=optimizer)
    moved = 0
    for n, p in model.named_parameters():
        assert torch.equal(p.detach()[~mask[n]], start[n][~mask[n]]), n
        moved += int((p.detach()[mask[n]] != start[n][mask[n]]).sum())
    assert moved > 0.5 * sum(int(m.sum()) for m in mask.values())


def test_precision_validation() -> None:
    from compute.train import prepare_precision

    with pytest.raises(ValueError, match="^precision:"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="^precision:"):
        prepare_precision(tiny_model("qwen3"), "half")


def test_gradient_sums_over_the_run_match_the_per_step_gradients() -> None:
    tok, task = char_tokenizer(), get_task("arithmetic-add?digits=1")
    model = tiny_model("qwen3")
    mask = _random_mask(model, 0.5)
    seen: list[dict[str, torch.Tensor]] = []

    shapes = {n: p.shape for n, p in model.named_parameters()}

    def hook(step, params):  # a partly masked tensor's gradient is folded onto its coordinates
        seen.append({n: (g.detach().clone() if c is None else c.dense(g, shapes[n]))
                     for n, g, c in grads_of(params)})

    res = train(model, tok, task, _cfg("sft", steps=3, track_gradients=True),
                mask=mask, evaluate=False, grad_hook=hook)
    assert res.updates == len(seen) == 3 and res.grad_sq_sum is not None and res.grad_abs_sum is not None
    assert set(res.grad_sq_sum) == {n for n, _ in model.named_parameters()}
    for n in res.grad_sq_sum:
        sq = sum((g[n].double() ** 2 for g in seen if n in g), torch.zeros(res.grad_sq_sum[n].shape).double())
        ab = sum((g[n].double().abs() for g in seen if n in g), torch.zeros(res.grad_abs_sum[n].shape).double())
        assert_close(res.grad_sq_sum[n].double(), sq, rtol=1e-5, atol=1e-12)
        assert_close(res.grad_abs_sum[n].double(), ab, rtol=1e-5, atol=1e-12)
        # off the mask the accumulated gradient is exactly zero
        assert float(res.grad_sq_sum[n][~mask[n]].abs().sum()) == 0.0
    assert sum(float(t.sum()) for t in res.grad_sq_sum.values()) > 0


def test_training_gradient_is_n_over_t_times_the_bound_gradient() -> None:
    """The bound reports the sequence-form g = mean_n A_n s_n; the token-mean GRPO loss's gradient
    on the same first batch is -(N/T) g. Checked against the training loop's own gradient."""
    from compute.studies.bound import first_step_bound, summarize


    tok, task = char_tokenizer(), ParityTask(get_task("arithmetic-add?digits=1"))
    model = tiny_model("qwen3")
    cfg = _cfg("grpo", steps=1, batch=3, group=4, max_new_tokens=5, scale_std=True)
    b = first_step_bound(model, tok, task, prompts=3, group=4, max_new_tokens=5, seed=cfg.seed)
    summary, _, _ = summarize(b)
    assert summary["bound_independent"] is False and summary["identity_fraction_holds"] == 1.0
    n_over_t = summary["bound_n_over_t"]
    assert n_over_t == pytest.approx(b.n_samples / b.n_tokens) and 0 < n_over_t <= 1
    seen: dict[str, torch.Tensor] = {}

    def hook(step, params):
        seen.update({n: p.grad.detach().double().abs() for n, p, _m in params if p.grad is not None})

    train(copy.deepcopy(model), tok, task, cfg, evaluate=False, grad_hook=hook)
    assert b.rms_advantage > 0 and any(float(b.lhs[n].max()) > 0 for n in b.lhs)
    for n in b.lhs:
        assert_close(seen[n], n_over_t * b.lhs[n], rtol=1e-3, atol=1e-4 * float(seen[n].max()) + 1e-12)


def _masked_torch_steps(model, mask, opt, micro: int, steps: int = 3) -> None:
    """torch's optimizer on gradients multiplied by the mask (the reference for ours)."""
    for s in range(steps):
        opt.zero_grad()
        for k in range(micro):
            _lm_loss(model, 10 * s + k).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                p.grad.mul_(mask[n].to(p.grad.dtype))
        opt.step()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("micro", [1, 2])
def test_masked_step_matches_torch_on_the_mask_with_micro_batches(kind: str, micro: int) -> None:
    """The folded path (Coords, 1-D state) against torch.optim on masked dense gradients, with
    `micro` backward passes accumulated per step, without weight decay (torch's decay would also
    shrink the frozen coordinates, hence change the next gradients): equal to float tolerance
    everywhere; and with decay, a 100% mask (every tensor all True) equals the dense torch
    optimizer everywhere."""
    a = tiny_model("qwen3")
    b = copy.deepcopy(a)
    g = torch.Generator().manual_seed(3)
    mask = {n: torch.rand(p.shape, generator=g) < 0.4 for n, p in a.named_parameters()}
    ours = {"lr": 1e-2, "weight_decay": 0.1} if kind == "adamw" else {"lr": 0.1, "weight_decay": 0.1,
                                                                          "momentum": 0.9}
    params = prepare_masked_params(a, mask)
    assert all(c is not None for _, _, c in params)  # every tensor partly masked: the folded path
    plain = {**ours, "weight_decay": 0.0}
    opt_a = MaskedOptimizer(params, kind, **plain)
    for s in range(3):
        opt_a.zero_grad()
        for k in range(micro):
            _lm_loss(a, 10 * s + k).backward()
        clip_grad_norm(params, None)
        opt_a.step()
    opt_a.close()
    opt_b = (torch.optim.AdamW(list(b.parameters()), **plain) if kind == "adamw"
             else torch.optim.SGD(list(b.parameters()), **plain))
    _masked_torch_steps(b, mask, opt_b, micro)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")

    full = {n: torch.ones(p.shape, dtype=torch.bool) for n, p in a.named_parameters()}
    c = tiny_model("qwen3")
    d = copy.deepcopy(c)
    opt_c = MaskedOptimizer(prepare_masked_params(c, full), kind, **ours)
    for s in range(3):
        opt_c.zero_grad()
        for k in range(micro):
            _lm_loss(c, 10 * s + k).backward()
        opt_c.step()
    opt_d = (torch.optim.AdamW(list(d.parameters()), **ours) if kind == "adamw"
             else torch.optim.SGD(list(d.parameters()), **ours))
    _masked_torch_steps(d, full, opt_d, micro)
    for (n, pc), (_, pd) in zip(c.named_parameters(), d.named_parameters(), strict=True):
        assert_close(pc, pd, rtol=1e-5, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")


def test_clip_norm_is_over_the_trainable_coordinates_only() -> None:
    model = tiny_model("qwen3")
    mask = _random_mask(model, 0.3)
    params = prepare_masked_params(model, mask)
    opt = MaskedOptimizer(params, "adamw")
    _lm_loss(model, 0).backward()
    ref = copy.deepcopy(model)  # the same loss, dense gradients (no hooks on the copy)
    for p in ref.parameters():
        p.requires_grad_(True)
        p.grad = None
    _lm_loss(ref, 0).backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad[mask[n]].double() for n, p in ref.named_parameters()]))
    got = clip_grad_norm(params, 1e-3)
    assert got == pytest.approx(float(want), rel=1e-5)
    clipped = torch.linalg.vector_norm(torch.cat([g.double().flatten() for _, g, _c in grads_of(params)]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-4)
    opt.close()


class _Tied(torch.nn.Module):
    """An input embedding and an output layer sharing one weight (a tied LM head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(40, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_tied_weight_uses_fold_their_own_gradients(kind: str) -> None:
    """With the model given, each use of a partly masked tied weight folds its gradient as it is
    computed (no dense .grad summed from both uses): the same folded gradient and step as the
    post-accumulate hook's path, frozen coordinates bit for bit, the modules restored by close()."""
    torch.manual_seed(0)
    a = _Tied()
    b = copy.deepcopy(a)
    b.head.weight = b.emb.weight
    g = torch.Generator().manual_seed(3)
    mask = {"emb.weight": torch.rand(40, 8, generator=g) < 0.3, "mid.weight": torch.ones(8, 8, dtype=torch.bool)}
    before = a.emb.weight.detach().clone()
    out = []
    for model, given in ((a, a), (b, None)):
        params = prepare_masked_params(model, mask)
        opt = MaskedOptimizer(params, kind, lr=1e-2, weight_decay=0.1, model=given)
        assert (type(model.head) is not torch.nn.Linear) == (given is not None)
        for step in range(2):
            for micro in range(2):  # two backward passes make one step
                ids = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(10 * step + micro))
                torch.nn.functional.cross_entropy(model(ids).reshape(-1, 40), ids.reshape(-1)).backward()
                assert model.emb.weight.grad is None  # folded, never dense on the weight
            out.append([c.grad.clone() for _, _, c in params if c is not None])
            opt.step()
            opt.zero_grad()
        opt.close()
        assert type(model.head) is torch.nn.Linear and type(model.emb) is torch.nn.Embedding
    for ga, gb in zip(out[:2], out[2:], strict=True):
        assert_close(ga, gb)
    assert_close(a.emb.weight, b.emb.weight)
    frozen = ~mask["emb.weight"]
    assert torch.equal(a.emb.weight.detach()[frozen], before[frozen])
    assert not torch.equal(a.emb.weight.detach()[~frozen], before[~frozen])


class _Scaled(torch.nn.Embedding):
    """A subclass whose forward scales super().forward() (as Gemma's scaled word embedding)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 3.0


class _Layers(torch.nn.Module):
    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.emb = _Scaled(300, 16, padding_idx=padding_idx)
        self.up = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(48, 300, bias=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.up(self.emb(ids))))


@pytest.mark.parametrize("padding_idx", [None, 7])
def test_linear_and_embedding_uses_fold_without_a_dense_gradient(monkeypatch: pytest.MonkeyPatch,
                                                                  padding_idx: int | None) -> None:
    """Issue 30: a partly masked nn.Linear weight's gradient is folded a block of output rows at a
    time, an nn.Embedding's (a subclass that calls super().forward() included) from its looked-up
    rows only; the folded values, the input gradients upstream and the dense bias's gradient
    equal autograd's dense gradients at the mask (float tolerance), and no .grad is ever built on
    a folded weight. Blocks of 1 KiB (4 rows of 48) force many blocks, some without a trainable
    coordinate (skipped), and ids repeat and hit the padding row."""
    from compute.contract import cost

    monkeypatch.setattr(cost, "FOLD_BLOCK_BYTES", 1024)
    torch.manual_seed(0)
    a = _Layers(padding_idx)
    b = copy.deepcopy(a)
    g = torch.Generator().manual_seed(5)
    mask = {"emb.weight": torch.rand(300, 16, generator=g) < 0.05,
            "up.weight": torch.rand(48, 16, generator=g) < 0.3,
            "head.weight": torch.rand(300, 48, generator=g) < 0.02, "head.bias": torch.ones(300, dtype=torch.bool)}
    mask["head.weight"][40:120] = False  # blocks with nothing to fold
    ids = torch.randint(0, 30, (4, 9), generator=g)
    ids[0, :3] = 7
    params = prepare_masked_params(a, mask)
    opt = MaskedOptimizer(params, "adamw", model=a)
    assert type(a.emb).__mro__[1] is _Scaled and type(a.head) is not torch.nn.Linear
    for _ in range(2):  # two backward passes add up
        torch.nn.functional.cross_entropy(a(ids).reshape(-1, 300), ids.reshape(-1)).backward()
    assert all(p.grad is None for n, p, c in params if c is not None)
    for p in b.parameters():
        p.requires_grad_(True)
    for _ in range(2):
        torch.nn.functional.cross_entropy(b(ids).reshape(-1, 300), ids.reshape(-1)).backward()
    ref = dict(b.named_parameters())
    for n, p, c in params:
        want = ref[n].grad
        if c is None:
            assert_close(p.grad, want)
        else:
            assert_close(c.grad, want.reshape(-1)[c.idx.long()], rtol=1e-5, atol=1e-7)
    if padding_idx is not None:
        c = next(c for n, _p, c in params if n == "emb.weight")
        at_pad = (c.idx.long() // 16) == padding_idx
        assert at_pad.any() and torch.all(c.grad[at_pad] == 0)
    opt.close()
    assert type(a.emb) is _Scaled and type(a.head) is torch.nn.Linear


def test_a_weight_with_another_kind_of_user_is_left_to_the_hook() -> None:
    """A partly masked weight that some module uses other than as nn.Linear / nn.Embedding's
    weight keeps autograd's gradient for every use (folded by the post-accumulate hook): no use
    is patched, and the folded gradient still equals the dense one."""

    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 6, bias=False)
            self.bilinear = torch.nn.Module()
            self.bilinear.weight = self.lin.weight  # used by hand below

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) @ self.bilinear.weight

    torch.manual_seed(1)
    m = Other()
    ref = copy.deepcopy(m)
    mask = {"lin.weight": torch.rand(6, 6) < 0.5}
    params = prepare_masked_params(m, mask)
    opt = MaskedOptimizer(params, "sgd", model=m)
    assert type(m.lin) is torch.nn.Linear
    x = torch.randn(3, 6)
    m(x).square().sum().backward()
    ref(x).square().sum().backward()
    c = params[0][2]
    assert_close(c.grad, ref.lin.weight.grad.reshape(-1)[c.idx.long()])
    opt.close()
