"""The headline experiment: do fixed sparse masks chosen from the initial Fisher retain the gain
of full post-training?

    initial Fisher -> one mask per (selector, density) -> for each seed: a full run and one
    masked run per mask, identical settings (prompts, sampling seeds, optimizer) -> held-out greedy
    accuracy -> retention = (masked - base) / (full - base), mean and spread over seeds.

Also reported: update sparsity of each full run (compute.diff) and how well the initial Fisher
predicts that update (precision@k against the changed coordinates and the top-1% |delta|).
Masks that do not depend on the seed (fisher*, magnitude*) are built once; random and gradient
masks are rebuilt per seed.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SEED_DEPENDENT = ("random", "gradient")


def retention(masked: float, full: float, base: float) -> float:
    """(masked - base) / (full - base); nan when full training did not move the reward."""
    gain = full - base
    return (masked - base) / gain if abs(gain) > 1e-12 else float("nan")


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value) of the finite values; (nan, nan) if none."""
    v = [x for x in xs if not math.isnan(x)]
    if not v:
        return float("nan"), float("nan")
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def build_table(
    base: float,
    full: list[float],
    masked: dict[tuple[str, float], list[float]],
    densities_actual: dict[tuple[str, float], float] | None = None,
) -> dict[str, Any]:
    """Rows per (selector, density) from per-seed held-out rewards (lists aligned by seed)."""
    fm, fs = mean_std(full)
    rows = []
    for (sel, dens), rewards in masked.items():
        rets = [retention(m, f, base) for m, f in zip(rewards, full, strict=True)]
        rm, rs = mean_std(rewards)
        tm, ts = mean_std(rets)
        rows.append({
            "selector": sel, "density": dens,
            "actual_density": (densities_actual or {}).get((sel, dens), dens),
            "reward_mean": rm, "reward_std": rs, "rewards": rewards,
            "retention_mean": tm, "retention_std": ts, "retentions": rets,
            "retention_of_means": retention(rm, fm, base),
        })
    return {"base_reward": base, "full_reward_mean": fm, "full_reward_std": fs, "full_rewards": full,
            "rows": rows}


def _fmt(x: float, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown_table(table: dict[str, Any]) -> str:
    """The retention table as GitHub markdown (mean ± std over seeds)."""
    n = len(table["full_rewards"])
    lines = [
        f"base held-out reward: {_fmt(table['base_reward'])}; full training: "
        f"{_fmt(table['full_reward_mean'])} ± {_fmt(table['full_reward_std'])} (seeds: {n})",
        "",
        "| selector | density | held-out reward | retention | retention of means |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in table["rows"]:
        lines.append(
            f"| {r['selector']} | {r['density']:g} | {_fmt(r['reward_mean'])} ± {_fmt(r['reward_std'])} "
            f"| {_fmt(r['retention_mean'], 2)} ± {_fmt(r['retention_std'], 2)} "
            f"| {_fmt(r['retention_of_means'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def run_retention(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    config: Any,
    selectors: list[str],
    densities: list[float],
    seeds: int,
    fisher_config: Any,
    teacher: torch.nn.Module | None = None,
    progress: Callable[[float, str], None] | None = None,
    first_seed: int = 0,
) -> dict[str, Any]:
    """Run the whole grid; `config` is the TrainConfig shared by every run (its seed is replaced
    by first_seed .. first_seed+seeds-1). The model is not modified (each run trains a copy).
    Seeds are independent: grids over disjoint seed ranges can be merged row by row."""
    from compute.fisher import estimate_fisher
    from compute.models import greedy_accuracy
    from compute.run_train import build_mask_in_memory, update_sparsity
    from compute.train import TrainConfig, train

    prog = progress or (lambda f, m="": None)
    t0 = time.perf_counter()
    n_runs = seeds * (1 + len(selectors) * len(densities))
    done = 0

    def acc(m: torch.nn.Module) -> float:
        return greedy_accuracy(m, tokenizer, task, n=config.eval_prompts, split="test", seed=0,
                               max_new_tokens=config.eval_max_new_tokens)

    prog(0.0, "base accuracy")
    base = acc(model)
    prog(0.01, "initial Fisher")
    fres = estimate_fisher(model, tokenizer, task, fisher_config)
    fisher = fres.fisher
    base_sd = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    masks: dict[tuple[str, float, int], dict[str, torch.Tensor]] = {}
    actual: dict[tuple[str, float], float] = {}

    def get_mask(sel: str, dens: float, seed: int) -> dict[str, torch.Tensor]:
        key = (sel, dens, seed if sel in SEED_DEPENDENT else -1)
        if key not in masks:
            cfg = TrainConfig(**{**config.__dict__, "seed": seed})
            masks[key], info = build_mask_in_memory(
                model, tokenizer, task, sel, dens, seed, fisher=fisher, gradient_config=cfg,
                teacher=teacher,
            )
            actual[(sel, dens)] = info["actual_density"]
        return masks[key]

    def one_run(seed: int, mask: dict[str, torch.Tensor] | None, label: str) -> tuple[float, Any, Any]:
        nonlocal done
        m = copy.deepcopy(model)
        cfg = TrainConfig(**{**config.__dict__, "seed": seed})
        res = train(m, tokenizer, task, cfg, mask=mask, teacher=teacher, evaluate=False,
                    progress=lambda f, msg="": prog((done + f) / n_runs * 0.98 + 0.02, f"{label}: {msg}"))
        a = acc(m)
        done += 1
        return a, res, m

    full: list[float] = []
    full_sparsity: list[dict[str, Any]] = []
    curves: dict[str, list[list[dict[str, float]]]] = {}
    masked: dict[tuple[str, float], list[float]] = {(s, d): [] for s in selectors for d in densities}
    for seed in range(first_seed, first_seed + seeds):
        a, res, m = one_run(seed, None, f"seed {seed} full")
        full.append(a)
        curves.setdefault("full", []).append(res.curve)
        full_sparsity.append(update_sparsity(base_sd, m, fisher))
        del m
        for sel in selectors:
            for dens in densities:
                a, res, m = one_run(seed, get_mask(sel, dens, seed), f"seed {seed} {sel}@{dens:g}")
                masked[(sel, dens)].append(a)
                curves.setdefault(f"{sel}@{dens:g}", []).append(res.curve)
                del m
    table = build_table(base, full, masked, actual)
    keys = sorted({k for s in full_sparsity for k, v in s.items() if isinstance(v, (int, float))})
    table["full_update_sparsity"] = {k: mean_std([float(s[k]) for s in full_sparsity
                                                  if s.get(k) is not None])[0] for k in keys}
    table["full_update_sparsity_per_seed"] = full_sparsity
    table["fisher"] = {"estimator": fres.estimator, "rows": fres.n_rows, "tokens": fres.n_tokens,
                       "prompts": fisher_config.prompts, "samples": fisher_config.samples}
    table["curves"] = curves
    table["seconds"] = round(time.perf_counter() - t0, 1)
    table["runs"] = n_runs
    table["seeds"] = list(range(first_seed, first_seed + seeds))
    prog(1.0, "done")
    return table
