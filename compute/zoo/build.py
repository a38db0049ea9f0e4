"""Building the arithmetic zoo: install the shipped weights, or train them from scratch by SFT
(base: first checkpoint reaching the validation target; teacher: the best of a cosine-decayed
continuation), and `ship` them back into compute/zoo_weights with their manifest."""

from __future__ import annotations

import hashlib
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from compute.contract.jobresult import Progress
from compute.contract.modelref import ZOO_NAMES, file_sha256, folder_revision
from compute.lm.causal_lm import greedy_generate
from compute.lm.verifiable_tasks import get_task
from compute.zoo.folders import INFO_FILE, is_built, save
from compute.zoo.recipe import FAMILIES, ZooRecipe, build_model, family_of
from compute.zoo.shipped import (
    MANIFEST_FILE,
    SHIPPED_FILES,
    WEIGHTS_DIR,
    install_shipped,
    read_manifest,
)
from compute.zoo.vocab import build_tokenizer, is_val, sft_tensors

ZOO_TASK = "arithmetic"
# Fixed, since float reductions depend on it. One thread: the model is so small that a second
# thread barely helps, and it keeps the build fast on a busy machine.
BUILD_THREADS = 1
# The recorded info copied into the manifest entry of each shipped model.
MANIFEST_INFO_KEYS = (
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
    "cpu_fingerprint",
    "build_seconds",
)


def _check_build_args(
    names: list[str], seed: int, recipe: ZooRecipe | None, from_scratch: bool
) -> None:
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


def build_zoo(
    zoo_dir: str | Path,
    names: list[str] | tuple[str, ...] | None = None,
    progress: Progress | None = None,
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
    _check_build_args(names, seed, recipe, from_scratch)
    zoo_dir = Path(zoo_dir).expanduser()
    zoo_dir.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda fraction, message: None)
    todo = [n for n in names if force or not is_built(zoo_dir / n)]
    results = {n: json.loads((zoo_dir / n / INFO_FILE).read_text()) for n in names if n not in todo}
    if not todo:
        report(1.0, "zoo already built")
    elif not from_scratch:
        for i, n in enumerate(todo):
            report(i / len(todo), f"installing shipped {n}")
            results[n] = install_shipped(zoo_dir, n)
        report(1.0, "zoo installed (shipped weights, sha256 verified)")
    else:
        _train_families(zoo_dir, todo, results, report, seed, recipe)
        report(1.0, "zoo built")
    return [results[n] for n in names]


def _train_families(
    zoo_dir: Path,
    todo: list[str],
    results: dict[str, Any],
    report: Progress,
    seed: int,
    recipe: ZooRecipe | None,
) -> None:
    """One SFT run per family that has a name in `todo`, on BUILD_THREADS threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        fams = [f for f in FAMILIES if any(family_of(n) == f for n in todo)]
        for k, fam in enumerate(fams):
            fam_recipe, base, teacher = FAMILIES[fam]

            def fam_report(fraction: float, message: str, k: int = k) -> None:
                report((k + fraction) / len(fams), message)

            run = _SFTRun(zoo_dir, recipe or fam_recipe, seed, fam_report)
            results.update(
                run.train_family(base, teacher, [n for n in todo if n in (base, teacher)])
            )
    finally:
        torch.set_num_threads(threads)


def _accuracy(model: Any, tokenizer: Any, task: Any, examples: list[Any]) -> float:
    completions = greedy_generate(model, tokenizer, [e.prompt for e in examples], max_new_tokens=6)
    hits = sum(task.reward(c, e.answer) for c, e in zip(completions, examples, strict=True))
    return hits / len(examples)


def _cpu_capability() -> str:
    """The SIMD level torch's CPU kernels use (float results can differ between levels)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - older torch
        return platform.machine()


def cpu_fingerprint() -> str:
    """What decides the float results of a CPU build beyond torch's SIMD level: the CPU's vector
    and matrix extensions (MKL picks its GEMM kernels by them: an AMX machine and an AVX512 one
    without it train different bytes at the same `cpu_capability`) and the BLAS build. A short
    sha256, recorded by `ship` so the reproduction test knows when it can compare."""
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        keep = sorted(f for f in line.split(":", 1)[-1].split()
                      if f.startswith(("avx", "amx", "fma", "f16c", "sse", "ssse")))
        flags = " ".join(keep)
    except OSError:
        flags = platform.processor()
    blas = next((ln.strip() for ln in torch.__config__.show().splitlines() if "Math Kernel" in ln
                 or "OpenBLAS" in ln), "")
    raw = f"{platform.machine()}|{_cpu_capability()}|{flags}|{blas}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


class _SFTRun:
    """One family's SFT run: the model, its optimiser, the SFT pool and the validation set."""

    def __init__(
        self, zoo_dir: Path, recipe: ZooRecipe, seed: int, report: Progress
    ):
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.zoo_dir, self.recipe, self.seed, self.report = zoo_dir, recipe, seed, report
        self.task = get_task(ZOO_TASK)
        self.tokenizer = build_tokenizer()
        self.model = build_model(self.tokenizer, recipe, seed)
        self.model.train()
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay
        )
        # SFT pool and validation set: disjoint parts of the train split (test stays unseen).
        draws = self.task.examples(40_000, seed=seed, split="train")
        # (input_ids, attention_mask, labels), each (N, L)
        self.pool = sft_tensors(self.tokenizer, [e for e in draws if not is_val(e.prompt)])
        self.val = [e for e in draws if is_val(e.prompt)][: recipe.val_prompts]
        self.gen = torch.Generator().manual_seed(seed)
        self.history: list[tuple[int, float]] = []

    def step(self, step: int, lr: float) -> float:
        """One AdamW step at `lr` (after linear warmup) on a random batch; returns the loss."""
        for g in self.opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / self.recipe.warmup_steps)
        pool_ids, pool_mask, pool_labels = self.pool
        idx = torch.randint(len(pool_ids), (self.recipe.batch_size,), generator=self.gen)
        ids, mask, labels = pool_ids[idx], pool_mask[idx], pool_labels[idx]  # (B, L)
        width = int(mask.sum(1).max())
        loss = self.model(
            input_ids=ids[:, :width], attention_mask=mask[:, :width], labels=labels[:, :width]
        ).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())

    def validate(self, step: int, stage: str, loss: float) -> float:
        acc = _accuracy(self.model, self.tokenizer, self.task, self.val)
        self.model.train()
        self.history.append((step, round(acc, 4)))
        total_guess = self.recipe.base_max_steps // 3 + self.recipe.teacher_steps  # bar only
        self.report(
            min(0.99, step / total_guess),
            f"{stage}: step {step}, loss {loss:.3f}, val acc {acc:.2f}",
        )
        return acc

    def finish(self, name: str, step: int, val_acc: float) -> dict[str, Any]:
        """Measure held-out accuracy, save the model as `name`; returns its recorded info."""
        recipe = self.recipe
        test = self.task.examples(recipe.test_prompts, split="test")
        test_acc = _accuracy(self.model, self.tokenizer, self.task, test)
        self.model.train()
        info = {
            "name": name,
            "architecture": "Qwen3ForCausalLM",
            "params": sum(p.numel() for p in self.model.parameters()),
            "n_layers": recipe.num_layers,
            "task": ZOO_TASK,
            "accuracy": test_acc,
            "accuracy_split": "test",
            "accuracy_prompts": recipe.test_prompts,
            "accuracy_decoding": "greedy",
            "val_accuracy": val_acc,
            "train_steps": step,
            "seed": self.seed,
            "build_seconds": round(time.perf_counter() - self.t0, 2),
            "build_cpu_seconds": round(time.process_time() - self.c0, 2),
            "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
            "cpu_capability": _cpu_capability(),
            "cpu_fingerprint": cpu_fingerprint(),
            "tied_embeddings": False,
            "recipe": asdict(recipe),
            "val_history": list(self.history),
        }
        save(self.model, self.tokenizer, self.zoo_dir / name, info)
        return info

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def train_family(self, base_name: str, teacher_name: str, todo: list[str]) -> dict[str, Any]:
        """Stage 1 (constant LR until val accuracy reaches base_target) -> the base; stage 2
        (teacher_steps more, cosine-decayed LR, best val checkpoint kept) -> the teacher."""
        recipe, out = self.recipe, {}
        step, val_acc, loss = 0, 0.0, float("nan")
        while step < recipe.base_max_steps:
            loss = self.step(step, recipe.lr)
            step += 1
            if step % recipe.eval_every == 0:
                val_acc = self.validate(step, base_name, loss)
                if val_acc >= recipe.base_target:
                    break
        if base_name in todo:
            out[base_name] = self.finish(base_name, step, val_acc)
        if teacher_name not in todo:
            return out
        base_step = step
        best = (val_acc, step, self.snapshot())
        for i in range(recipe.teacher_steps):
            # written as before the split, so the float result (and the shipped build) is the same
            lr = recipe.lr * (
                0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * i / recipe.teacher_steps))
            )
            loss = self.step(step, lr)
            step += 1
            if (step - base_step) % recipe.eval_every == 0:
                val_acc = self.validate(step, teacher_name, loss)
                if val_acc > best[0]:
                    best = (val_acc, step, self.snapshot())
        self.model.load_state_dict(best[2])
        out[teacher_name] = self.finish(teacher_name, best[1], best[0])
        return out


def _manifest_entry(dst: Path, info: dict[str, Any]) -> dict[str, Any]:
    return {
        "files": {f: file_sha256(dst / f) for f in SHIPPED_FILES},
        "revision": folder_revision(dst),
        "family": family_of(info["name"]),
        **{k: info[k] for k in MANIFEST_INFO_KEYS},
    }


def ship(names: list[str] | None = None, weights_dir: str | Path | None = None) -> dict[str, Any]:
    """Train `names` (default all) from scratch and write them, with the manifest, into
    `weights_dir` (default compute/zoo_weights): what `build_zoo` installs afterwards."""
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
            dst = weights_dir / info["name"]
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir(parents=True)
            for fname in SHIPPED_FILES:
                shutil.copyfile(Path(tmp) / info["name"] / fname, dst / fname)
            manifest["models"][info["name"]] = _manifest_entry(dst, info)
    manifest["about"] = (
        "Shipped zoo weights: sha256 of every file, the content revision (as "
        "compute.contract.modelref.model_revision computes it) and the held-out accuracy measured by the "
        "build (greedy, test split). Written by `python -m compute.zoo ship`."
    )
    manifest["models"] = dict(sorted(manifest["models"].items()))
    (weights_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    """`python -m compute.zoo ship [NAMES...]`: retrain and rewrite the shipped weights."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "ship":
        raise SystemExit("usage: python -m compute.zoo ship [NAME ...]")
    manifest = ship(args[1:] or None)
    for name, entry in manifest["models"].items():
        print(f"{name}: accuracy {entry['accuracy']:.1%}, revision {entry['revision'][:16]}")
