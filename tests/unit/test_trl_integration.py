"""fisherlens masks inside TRL's real trainers (compute/integrations/trl.py).

GRPOTrainer and SFTTrainer on the zoo model `arith-base`, AdamW with weight_decay=0.1 and a large
learning rate, fp32 and bf16: every frozen coordinate is bit-identical after training, trainable
ones moved, the logged grad_norm equals the norm of the masked gradient computed independently
(from the raw gradients autograd hands each parameter, captured by a tensor hook that runs before
the callback's hook), clipping sees only trainable coordinates, and UpdateSparsityCallback logs
the numbers `compute.sparsity.diff` computes on the saved model.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from compute.integrations.trl import (  # noqa: E402
    FisherMaskCallback,
    UpdateSparsityCallback,
    match_parameters,
)
from compute.sparsity.diff import Checkpoint, diff_checkpoints  # noqa: E402
from compute.sparsity.masks import random_mask, save_mask  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FROZEN = "model.layers.0.self_attn.q_proj.weight"  # all False in the test mask
DENSE = "model.norm.weight"  # all True


def _mask(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    m = random_mask({n: p.shape for n, p in model.named_parameters()}, 0.1, seed=0)
    m[FROZEN][:] = False
    m[DENSE][:] = True
    return m


def _load(zoo_home: Path, dtype: torch.dtype) -> tuple[Any, Any, Path]:
    path = zoo_home / "zoo" / "arith-base"
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path), path


class GradProbe(TrainerCallback):
    """Independent record per optimizer step: the raw gradients (summed over micro-batches, taken
    before any masking by a tensor hook on each parameter), and the gradients the optimizer gets."""

    def __init__(self, model: torch.nn.Module, mask: dict[str, torch.Tensor]):
        self.mask = mask
        self.raw: dict[str, torch.Tensor] = {}
        self.steps: list[dict[str, float]] = []
        self.params = dict(model.named_parameters())
        for n, p in self.params.items():
            p.register_hook(self._capture(n))

    def _capture(self, name: str) -> Any:
        def hook(g: torch.Tensor) -> None:
            g = g.detach().to(torch.float64)  # a copy: autograd may store g itself as .grad
            self.raw[name] = self.raw[name] + g if name in self.raw else g

        return hook

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.raw = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        masked = math.sqrt(sum(float((g * self.mask[n]).square().sum()) for n, g in self.raw.items()))
        raw = math.sqrt(sum(float(g.square().sum()) for g in self.raw.values()))
        seen = [p.grad.double() for p in self.params.values() if p.grad is not None]
        off = sum(int((p.grad != 0)[~self.mask[n]].sum()) for n, p in self.params.items() if p.grad is not None)
        self.steps.append({"masked": masked, "raw": raw, "off_mask_nonzero": off,
                           "clipped": math.sqrt(sum(float(g.square().sum()) for g in seen)),
                           "frozen_grad": float(self.params[FROZEN].grad is not None)})


def _reward(completions: list[str], **kw: Any) -> list[float]:
    # a deterministic reward that differs between completions, so every group has an advantage
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _check_frozen_and_moved(model: torch.nn.Module, before: dict[str, torch.Tensor],
                            mask: dict[str, torch.Tensor]) -> None:
    moved_partial = 0
    for n, p in model.named_parameters():
        w = p.detach()
        assert w.dtype == before[n].dtype
        frozen = ~mask[n]
        # bit-identical: compare the bit patterns, not values (-0.0 vs +0.0, NaN)
        bits = torch.int16 if w.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(w.view(bits)[frozen], before[n].view(bits)[frozen]), f"{n}: a frozen coordinate moved"
        if n not in (FROZEN, DENSE):
            moved_partial += int((w != before[n])[mask[n]].sum())
    assert moved_partial > 100
    assert not torch.equal(dict(model.named_parameters())[DENSE].detach(), before[DENSE])


def _check_grad_norms(trainer: Any, probe: GradProbe, max_grad_norm: float, rel: float) -> None:
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(logged) == len(probe.steps) == trainer.state.global_step
    for g, s in zip(logged, probe.steps, strict=True):
        assert s["off_mask_nonzero"] == 0 and s["frozen_grad"] == 0.0
        assert g == pytest.approx(s["masked"], rel=rel)
        assert s["raw"] > 1.5 * s["masked"]  # the unmasked gradient would have logged another number
        # clipping used the masked norm: the optimizer's gradient has norm exactly min(norm, max)
        assert s["clipped"] == pytest.approx(min(s["masked"], max_grad_norm), rel=rel)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grpo_trainer_trains_only_inside_the_mask(zoo_home: Path, tmp_path: Path, precision: str) -> None:
    bf16 = precision == "bf16"
    model, tok, base = _load(zoo_home, torch.bfloat16 if bf16 else torch.float32)
    mask = _mask(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = GradProbe(model, mask)
    max_grad_norm = 0.5
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, learning_rate=3e-2, weight_decay=0.1, max_grad_norm=max_grad_norm,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=bf16, seed=0,
    )
    ds = Dataset.from_list([{"prompt": f"{i}+{i + 1}="} for i in range(12)])
    cb = FisherMaskCallback(save_mask(mask, tmp_path / "mask.safetensors"))
    sparsity = UpdateSparsityCallback(base=str(base), every=2)
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[probe, cb, sparsity])
    assert not dict(model.named_parameters())[FROZEN].requires_grad  # frozen before the optimizer
    trainer.train()
    _check_frozen_and_moved(model, before, mask)
    _check_grad_norms(trainer, probe, max_grad_norm, rel=1e-2 if bf16 else 1e-5)
    assert cb.summary["frozen_tensors"] == 1 and cb.summary["dense_tensors"] == 1

    # sparsity logged at steps 2 and 3 (every=2, and the last step); step 3's numbers are those
    # of compute.sparsity.diff on the saved model
    rows = {h["step"]: h for h in trainer.state.log_history if "update_sparsity/unchanged_bf16" in h}
    assert sorted(rows) == [2, 3]
    trainer.save_model(str(tmp_path / "saved"))
    g = diff_checkpoints(Checkpoint(base), Checkpoint(tmp_path / "saved"), svd_max_numel=0).groups["global"]["all"]
    assert rows[3]["update_sparsity/unchanged_bf16"] == g["unchanged_bf16"]
    # issue 27: the headline in the lower of the two stored precisions (fp32 base, bf16 model: bf16)
    assert rows[3]["update_sparsity/unchanged"] == g["unchanged_common"]
    assert rows[3]["update_sparsity/compared_mantissa_bits"] == (7 if bf16 else 23)
    if bf16:
        assert g["unchanged_common"] == g["unchanged_bf16"] > 0.85 > g["unchanged_exact"]
    assert rows[3]["update_sparsity/unchanged_bf16delta_atol_1e-05"] == g["unchanged_bf16delta_atol_1e-05"]
    assert 0.85 < g["unchanged_bf16"] < 1.0  # ~90% of the coordinates are frozen


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sft_trainer_with_accumulation(zoo_home: Path, tmp_path: Path, precision: str) -> None:
    bf16 = precision == "bf16"
    model, tok, _ = _load(zoo_home, torch.bfloat16 if bf16 else torch.float32)
    mask = _mask(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = GradProbe(model, mask)
    args = SFTConfig(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-2, weight_decay=0.1, max_grad_norm=1e9,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=bf16, seed=0,
    )
    ds = Dataset.from_list([{"prompt": f"{i}+{i + 3}=", "completion": f"{2 * i + 3}"} for i in range(24)])
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                         callbacks=[probe])
    trainer.add_callback(FisherMaskCallback(mask))  # added after init: set up at train begin
    sparsity = UpdateSparsityCallback(every=1)  # base: the weights at train begin
    trainer.add_callback(sparsity)
    trainer.train()
    _check_frozen_and_moved(model, before, mask)
    _check_grad_norms(trainer, probe, 1e9, rel=1e-2 if bf16 else 1e-5)
    last = [h for h in trainer.state.log_history if "update_sparsity/unchanged_bf16" in h][-1]
    g = diff_checkpoints(before, {n: p.detach() for n, p in model.named_parameters()},
                         svd_max_numel=0).groups["global"]["all"]
    assert last["update_sparsity/unchanged_bf16"] == g["unchanged_bf16"]


def test_unknown_mask_names_are_refused(zoo_home: Path, tmp_path: Path) -> None:
    model, tok, _ = _load(zoo_home, torch.float32)
    mask = _mask(model)
    mask["model.layers.7.mlp.up_proj.weight"] = torch.ones(3, 3, dtype=torch.bool)
    mask["transformer.h.0.attn.weight"] = torch.ones(3, dtype=torch.bool)
    args = SFTConfig(output_dir=str(tmp_path / "o"), max_steps=1, report_to="none", use_cpu=True, bf16=False)
    ds = Dataset.from_list([{"text": "1+2=3"}])
    with pytest.raises(ValueError, match=r"mask: 2 name\(s\) match no parameter of the model: "
                                         r"'model.layers.7.mlp.up_proj.weight', 'transformer.h.0.attn.weight'"):
        SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                   callbacks=[FisherMaskCallback(mask)])
    bad = _mask(model)
    bad[DENSE] = torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask: parameter 'model.norm.weight' has shape \[5\] in the mask but \[64\]"):
        SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                   callbacks=[FisherMaskCallback(bad)])
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        FisherMaskCallback({DENSE: torch.full((64,), 0.5)})
    with pytest.raises(ValueError, match="mask: file not found"):
        FisherMaskCallback(tmp_path / "nope.safetensors")


def test_names_match_through_ties_and_prefixes() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    emb = "model.embed_tokens.weight"
    got = match_parameters(["lm_head.weight", "base_model.model.model.norm.weight", "layers.0.mlp.up_proj.weight",
                            "module.model.layers.0.input_layernorm.weight"], model)
    assert {k: v[0] for k, v in got.items()} == {
        "lm_head.weight": emb, "base_model.model.model.norm.weight": "model.norm.weight",
        "layers.0.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight",
        "module.model.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight"}
    assert got["lm_head.weight"][1] is dict(model.named_parameters())[emb]

    # a tied parameter named twice: the same mask is fine, different masks are refused
    from compute.integrations.trl import resolve_mask

    m = torch.zeros(40, 16, dtype=torch.bool)
    m[:3] = True
    res = resolve_mask({"lm_head.weight": m, emb: m.clone()}, model)
    assert torch.equal(res[emb], m) and not res["model.norm.weight"].any()  # absent: frozen
    with pytest.raises(ValueError, match="are the same \\(tied\\) parameter 'model.embed_tokens.weight'"):
        resolve_mask({"lm_head.weight": m, emb: ~m}, model)
    with pytest.raises(ValueError, match="mask: 1 parameter\\(s\\) of the model are not in the mask"):
        resolve_mask({n: torch.ones_like(p, dtype=torch.bool) for n, p in model.named_parameters()
                      if n != "model.norm.weight"}, model, unmasked="error")
    assert resolve_mask({emb: m}, model, unmasked="train")["model.norm.weight"] is None


def test_importing_fisherlens_does_not_import_trl_or_transformers() -> None:
    code = ("import sys, compute, compute.integrations, compute.sparsity.masks, compute.sparsity.diff; "
            "print(sorted(m for m in ('trl', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"


def test_example_script_runs_as_written(zoo_home: Path, tmp_path: Path) -> None:
    """examples/trl_grpo_mask.py, as the README runs it, on the zoo model: a run folder of
    checkpoint-N (the layout `fisherlens series` reads), frozen weights bit-identical."""
    model, _, base = _load(zoo_home, torch.float32)
    mask = _mask(model)
    save_mask(mask, tmp_path / "mask.safetensors")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FISHERLENS_HOME": str(zoo_home)}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo_mask.py"), "--model", "arith-base",
                        "--mask", str(tmp_path / "mask.safetensors"), "--steps", "3", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for step in (1, 2, 3):
        ck = out / f"checkpoint-{step}"
        assert (ck / "model.safetensors").is_file() and (ck / "trainer_state.json").is_file()
    final = Checkpoint(out / "checkpoint-3")
    b = Checkpoint(base)
    for n in b.names():
        w0, w1 = b.get(n), final.get(n)
        assert torch.equal(w1[~mask[n]], w0[~mask[n]]), n
    assert "update_sparsity/unchanged_bf16" in r.stdout


@pytest.mark.parametrize("trainer_kind", ["distillation", "hf-trainer"])
def test_distillation_and_plain_trainer(zoo_home: Path, tmp_path: Path, trainer_kind: str) -> None:
    """The same guarantees in TRL's DistillationTrainer (student arith-base, teacher arith-teacher)
    and in a plain transformers.Trainer."""
    model, tok, _ = _load(zoo_home, torch.float32)
    mask = _mask(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = GradProbe(model, mask)
    common = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                  learning_rate=3e-2, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1,
                  save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0)
    callbacks = [probe, FisherMaskCallback(mask)]
    trainer: Any
    if trainer_kind == "distillation":
        from trl import DistillationConfig, DistillationTrainer

        teacher = AutoModelForCausalLM.from_pretrained(zoo_home / "zoo" / "arith-teacher", dtype=torch.float32)
        tok.padding_side = "left"
        ds = Dataset.from_list([{"prompt": f"{i}+{i + 1}="} for i in range(12)])
        trainer = DistillationTrainer(model=model, teacher_model=teacher, train_dataset=ds, processing_class=tok,
                                      args=DistillationConfig(**common, max_completion_length=4),
                                      callbacks=callbacks)
    else:
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        ds = Dataset.from_list([dict(tok(f"{i}+{i + 3}={2 * i + 3}")) for i in range(12)])
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=ds,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=callbacks)
    trainer.train()
    _check_frozen_and_moved(model, before, mask)
    _check_grad_norms(trainer, probe, 0.5, rel=1e-5)
