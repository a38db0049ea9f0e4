"""fisherlens' own tiny models, built locally and deterministically (no network).

Both zoo models are the same small Qwen3-architecture causal LM (untied embeddings) with a
character-level tokenizer, trained by SFT on the train split of the `arithmetic` task
(prompt "12+34=", completion "46<eos>"):

- ``arith-base``: the first checkpoint (constant LR) whose greedy accuracy on a validation set
  reaches ``base_target`` (25%): partly trained, room for RL;
- ``arith-teacher``: the same run continued for ``teacher_steps`` with a cosine-decayed LR,
  keeping the checkpoint with the best validation accuracy: the teacher for on-policy
  distillation. Same architecture and tokenizer as the base, so logits compare directly.

The validation set is a hash-selected part of the task's train split that SFT never sees; the
test split is used only for the recorded accuracy. Stopping the base on measured accuracy (not a
fixed step count) keeps it in range for any seed. Held-out accuracy (500 test prompts, greedy)
is written with the recipe, steps, seed and timings to ``<zoo_dir>/<name>/fisherlens.json``.

Builds run on the CPU with `BUILD_THREADS` (1) torch thread, so they are bit-for-bit reproducible
given the seed, the recipe, the torch version and the CPU type.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from compute.modelref import ZOO_NAMES
from compute.models import greedy_accuracy, greedy_generate
from compute.tasks import get_task

ZOO_TASK = "arithmetic"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
# Every character the tokenizer knows (specials first). Enough for arithmetic and simple JSONL.
CHARS = "0123456789+-*/=.,()?: abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
INFO_FILE = "fisherlens.json"
# Fixed, since float reductions depend on it. One thread: the model is so small that a second
# thread barely helps, and it keeps the build fast on a busy machine.
BUILD_THREADS = 1

__all__ = [
    "ZOO_NAMES",
    "ZooRecipe",
    "build_tokenizer",
    "build_model",
    "build_zoo",
    "zoo_list",
    "greedy_accuracy",
    "greedy_generate",
    "sft_tensors",
]


@dataclass(frozen=True)
class ZooRecipe:
    """How the zoo models are built (recorded in each model's fisherlens.json)."""

    hidden_size: int = field(default=64, metadata={"help": "model width"})
    num_layers: int = field(default=2, metadata={"help": "transformer blocks"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    num_kv_heads: int = field(default=2, metadata={"help": "key/value heads (GQA)"})
    intermediate_size: int = field(default=192, metadata={"help": "MLP width"})
    batch_size: int = field(default=128, metadata={"help": "SFT sequences per step"})
    lr: float = field(
        default=3e-3, metadata={"help": "AdamW learning rate (constant after warmup)"}
    )
    warmup_steps: int = field(default=20, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    eval_every: int = field(default=25, metadata={"help": "steps between validation checks"})
    val_prompts: int = field(
        default=256, metadata={"help": "validation prompts (held-out part of train)"}
    )
    test_prompts: int = field(
        default=500, metadata={"help": "held-out test prompts for the record"}
    )
    base_target: float = field(default=0.25, metadata={"help": "val accuracy that stops the base"})
    base_max_steps: int = field(default=1500, metadata={"help": "cap on steps to the base"})
    teacher_steps: int = field(
        default=1000, metadata={"help": "steps after the base, cosine-decayed LR"}
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.base_target < 1.0:
            raise ValueError(f"base_target: {self.base_target} must be in (0, 1)")
        if self.eval_every < 1 or self.base_max_steps < self.eval_every:
            raise ValueError("eval_every: need 1 <= eval_every <= base_max_steps")
        if self.teacher_steps < self.eval_every:
            raise ValueError("teacher_steps: need teacher_steps >= eval_every")


def build_tokenizer() -> Any:
    """Character-level PreTrainedTokenizerFast: one token per character, pad/eos/bos/unk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character alone
    tok.decoder = decoders.Fuse()  # join tokens without spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="right",
        model_max_length=256,
    )
    return fast


def build_model(tokenizer: Any, recipe: ZooRecipe, seed: int) -> Any:
    """Randomly initialised Qwen3 causal LM (deterministic given seed)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.hidden_size // recipe.num_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    return model


def is_val(prompt: str) -> bool:
    """Train-split problems held out of SFT for checkpoint selection (by hash, about 1 in 8)."""
    return int.from_bytes(hashlib.sha256(b"val|" + prompt.encode()).digest()[:4], "big") % 8 == 0


def sft_tensors(tokenizer: Any, examples: list[Any]) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, labels), each (N, L), right-padded; labels on answer + eos."""
    rows, label_rows = [], []
    eos = tokenizer.eos_token_id  # property lookups are slow: read once
    unique = sorted({ex.prompt for ex in examples} | {ex.answer for ex in examples})
    encoded = dict(zip(unique, tokenizer(unique)["input_ids"], strict=True))
    for ex in examples:
        p, a = encoded[ex.prompt], encoded[ex.answer] + [eos]
        rows.append(p + a)
        label_rows.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids, mask, labels


def _save(model: Any, tokenizer: Any, out: Path, info: dict[str, Any]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard: its bar would only break our own
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)


def _is_built(path: Path) -> bool:
    return (path / INFO_FILE).is_file() and (path / "config.json").is_file()


def _accuracy(model: Any, tokenizer: Any, task: Any, examples: list[Any]) -> float:
    completions = greedy_generate(model, tokenizer, [e.prompt for e in examples], max_new_tokens=6)
    return sum(task.reward(c, e.answer) for c, e in zip(completions, examples, strict=True)) / len(
        examples
    )


def build_zoo(
    zoo_dir: str | Path,
    names: list[str] | tuple[str, ...] | None = None,
    progress: Callable[[float, str], None] | None = None,
    seed: int = 0,
    force: bool = True,
    recipe: ZooRecipe | None = None,
) -> list[dict[str, Any]]:
    """Build the zoo models `names` (default all) under `zoo_dir`; returns their info dicts.

    Deterministic given (seed, recipe, torch version). Both models come out of one SFT run, so
    building the teacher also trains through the base checkpoint. With force=False, models
    already built are kept (their recorded info is returned).
    """
    recipe = recipe or ZooRecipe()
    names = list(names) if names else list(ZOO_NAMES)
    for n in names:
        if n not in ZOO_NAMES:
            raise ValueError(f"names: unknown zoo model {n!r}; accepted: {', '.join(ZOO_NAMES)}")
    zoo_dir = Path(zoo_dir).expanduser()
    zoo_dir.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda fraction, message: None)
    todo = [n for n in names if force or not _is_built(zoo_dir / n)]
    results = {n: json.loads((zoo_dir / n / INFO_FILE).read_text()) for n in names if n not in todo}
    if not todo:
        report(1.0, "zoo already built")
        return [results[n] for n in names]

    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        _train_zoo(zoo_dir, todo, results, report, seed, recipe)
    finally:
        torch.set_num_threads(threads)
    report(1.0, "zoo built")
    return [results[n] for n in names]


def _train_zoo(
    zoo_dir: Path,
    todo: list[str],
    results: dict[str, Any],
    report: Callable[[float, str], None],
    seed: int,
    recipe: ZooRecipe,
) -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    task = get_task(ZOO_TASK)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, recipe, seed)
    n_params = sum(p.numel() for p in model.parameters())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)

    # SFT pool and validation set: disjoint parts of the train split (the test split stays unseen).
    draws = task.examples(40_000, seed=seed, split="train")
    pool_ids, pool_mask, pool_labels = sft_tensors(
        tokenizer, [e for e in draws if not is_val(e.prompt)]
    )
    val = [e for e in draws if is_val(e.prompt)][: recipe.val_prompts]
    gen = torch.Generator().manual_seed(seed)
    history: list[tuple[int, float]] = []
    total_guess = recipe.base_max_steps // 3 + recipe.teacher_steps  # for the progress bar only

    def train_step(step: int, lr: float) -> float:
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / recipe.warmup_steps)
        idx = torch.randint(len(pool_ids), (recipe.batch_size,), generator=gen)
        ids, mask, labels = pool_ids[idx], pool_mask[idx], pool_labels[idx]  # (B, L)
        width = int(mask.sum(1).max())
        loss = model(
            input_ids=ids[:, :width], attention_mask=mask[:, :width], labels=labels[:, :width]
        ).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    def validate(step: int, stage: str, loss: float) -> float:
        acc = _accuracy(model, tokenizer, task, val)
        model.train()
        history.append((step, round(acc, 4)))
        report(
            min(0.99, step / total_guess),
            f"{stage}: step {step}, loss {loss:.3f}, val acc {acc:.2f}",
        )
        return acc

    def finish(name: str, step: int, val_acc: float) -> None:
        test_acc = _accuracy(
            model, tokenizer, task, task.examples(recipe.test_prompts, split="test")
        )
        model.train()
        info = {
            "name": name,
            "architecture": "Qwen3ForCausalLM",
            "params": n_params,
            "task": ZOO_TASK,
            "accuracy": test_acc,
            "accuracy_split": "test",
            "accuracy_prompts": recipe.test_prompts,
            "accuracy_decoding": "greedy",
            "val_accuracy": val_acc,
            "train_steps": step,
            "seed": seed,
            "build_seconds": round(time.perf_counter() - t0, 2),
            "build_cpu_seconds": round(time.process_time() - c0, 2),
            "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
            "tied_embeddings": False,
            "recipe": asdict(recipe),
            "val_history": list(history),
        }
        _save(model, tokenizer, zoo_dir / name, info)
        results[name] = info

    # Stage 1: constant LR until validation accuracy first reaches base_target -> arith-base.
    step, val_acc, loss = 0, 0.0, float("nan")
    while step < recipe.base_max_steps:
        loss = train_step(step, recipe.lr)
        step += 1
        if step % recipe.eval_every == 0:
            val_acc = validate(step, "arith-base", loss)
            if val_acc >= recipe.base_target:
                break
    if "arith-base" in todo:
        finish("arith-base", step, val_acc)

    # Stage 2: teacher_steps more with cosine-decayed LR; keep the best validation checkpoint.
    if "arith-teacher" in todo:
        base_step = step
        best = (val_acc, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        for i in range(recipe.teacher_steps):
            lr = recipe.lr * (
                0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * i / recipe.teacher_steps))
            )
            loss = train_step(step, lr)
            step += 1
            if (step - base_step) % recipe.eval_every == 0:
                val_acc = validate(step, "arith-teacher", loss)
                if val_acc > best[0]:
                    best = (
                        val_acc,
                        step,
                        {k: v.detach().clone() for k, v in model.state_dict().items()},
                    )
        model.load_state_dict(best[2])
        finish("arith-teacher", best[1], best[0])


def zoo_list(zoo_dir: str | Path) -> list[dict[str, Any]]:
    """One row per zoo name: name, params, accuracy, path, built (bool)."""
    zoo_dir = Path(zoo_dir).expanduser()
    rows = []
    for name in ZOO_NAMES:
        path = zoo_dir / name
        info: dict[str, Any] = {}
        if _is_built(path):
            try:
                info = json.loads((path / INFO_FILE).read_text())
            except (OSError, json.JSONDecodeError):
                info = {}
        rows.append(
            {
                "name": name,
                "params": info.get("params"),
                "accuracy": info.get("accuracy"),
                "path": str(path),
                "built": bool(info),
            }
        )
    return rows
