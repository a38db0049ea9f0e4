"""The headline experiment: do fixed sparse masks chosen from the initial Fisher retain the gain
of full post-training?

    initial Fisher -> one mask per (selector, density) -> for each seed: a full run and one
    masked run per mask, with the SAME seed (same training prompts, same sampling seeds, same
    optimizer: paired seeds) -> per-prompt greedy reward of every model on the SAME held-out
    prompts (paired prompts) -> retention = (masked - base) / (full - base).

Statistics (what a reader needs to trust a ratio of two small differences):

- The evaluation size is chosen for a stated standard error: a reward in [0, 1] has variance at
  most 1/4, so n = ceil(0.25 / se^2) held-out prompts give every model's mean reward a standard
  error <= se. The measured SE of the base and of the full runs is reported beside it.
- The headline retention is the ratio of means, (mean masked - base) / (mean full - base), over
  seeds and prompts (a mean of per-seed ratios explodes when one seed barely moves).
- Confidence intervals by a paired, two-level percentile bootstrap: each replicate redraws the
  seeds (with replacement) and the held-out prompts (with replacement), the same draws for base,
  full and masked, so the pairing is kept. Reported: both levels together (the headline
  interval), seeds only (prompts fixed) and prompts only (seeds fixed).
- Full training must beat the base beyond its error: when the lower end of the gain's interval is
  not above 0, no retention is reported at all (None) and the result carries a warning; a ratio
  whose denominator is noise is not a finding.

Also reported: update sparsity of each full run (compute.sparsity.diff) and how well the initial Fisher
predicts that update.

This module is the maths and the parts of the grid: `train_arm` trains and evaluates one arm
(through compute.train's pure `train`), `grid_table` combines the base rewards and the arms into the
table. compute.jobs.retention_run runs the arms as independent units (child jobs when queued) and
chooses the masks; random and gradient masks depend on the seed, the others do not.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

SEED_DEPENDENT = ("random", "gradient")


def retention(masked: float, full: float, base: float) -> float:
    """(masked - base) / (full - base); nan when full training did not move the reward."""
    gain = full - base
    return (masked - base) / gain if abs(gain) > 1e-12 else float("nan")


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value) of the finite values; (nan, nan) if none."""
    v = [x for x in xs if x is not None and not math.isnan(x)]
    if not v:
        return float("nan"), float("nan")
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def eval_size_for_se(se: float, cap: int | None = None) -> int:
    """Held-out prompts so that the mean of any reward in [0, 1] has standard error <= se
    (variance <= 1/4): ceil(0.25 / se^2), at most `cap`."""
    if not 0.0 < se <= 0.5:
        raise ValueError(f"eval_se: got {se}; accepted range: > 0, <= 0.5")
    n = math.ceil(0.25 / se**2 - 1e-9)
    return min(n, cap) if cap else n


# ---------------------------------------------------------------------------------------------
# statistics over paired seeds x paired prompts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BootstrapConfig:
    replicates: int = field(default=2000, metadata={"help": "bootstrap replicates"})
    confidence: float = field(default=0.95, metadata={"help": "two-sided confidence level"})
    seed: int = field(default=0, metadata={"help": "seed of the bootstrap draws"})

    def __post_init__(self) -> None:
        if not 100 <= self.replicates <= 1_000_000:
            raise ValueError(f"bootstrap: got {self.replicates}; accepted range: >= 100, <= 1000000")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence: got {self.confidence}; accepted range: >= 0.5, < 1")


def _resample_weights(n: int, reps: int, gen: torch.Generator, fixed: bool) -> torch.Tensor:
    """(reps, n) float64 weights summing to 1 per row: multinomial counts / n of a bootstrap draw
    (or the plain mean, 1/n each, when `fixed`)."""
    if fixed:
        return torch.full((reps, n), 1.0 / n, dtype=torch.float64)
    idx = torch.randint(n, (reps, n), generator=gen)
    counts = torch.zeros(reps, n, dtype=torch.float64)
    counts.scatter_add_(1, idx, torch.ones(reps, n, dtype=torch.float64))
    return counts / n


CHUNK_ELEMENTS = 8_000_000  # bootstrap weights held at once (replicates x prompts), 64 MB float64


@dataclass
class _Draws:
    """Bootstrap weights of one resampling scheme, in chunks of replicates so that memory stays
    bounded whatever replicates x prompts: prompts (r, n) and seeds (r, S) per chunk."""

    chunks: list[tuple[torch.Tensor, torch.Tensor]]

    def base(self, b: torch.Tensor) -> torch.Tensor:  # b: (n,) -> (R,)
        return torch.cat([w @ b for w, _ in self.chunks])

    def runs(self, x: torch.Tensor) -> torch.Tensor:  # x: (S, n) -> (R,)
        return torch.cat([(u * (w @ x.T)).sum(1) for w, u in self.chunks])  # (r, S) per chunk


def _draws(S: int, n: int, cfg: BootstrapConfig) -> dict[str, _Draws]:
    """The three schemes (both, seeds only, prompts only), the same for every call with the same
    (S, n, cfg), so base, full and every mask are resampled identically (paired)."""
    gen = torch.Generator().manual_seed(int(cfg.seed))
    step = max(1, CHUNK_ELEMENTS // max(n, S))
    out = {}
    for name, fix_seeds, fix_prompts in (("both", False, False), ("seeds", False, True), ("prompts", True, False)):
        chunks = []
        for start in range(0, cfg.replicates, step):
            r = min(step, cfg.replicates - start)
            chunks.append((_resample_weights(n, r, gen, fix_prompts), _resample_weights(S, r, gen, fix_seeds)))
        out[name] = _Draws(chunks)
    return out


def _quantiles(x: torch.Tensor, conf: float) -> list[float]:
    """Percentile interval; +-inf entries (ratios with a non-positive denominator) stay in the
    ordering, so an interval reaching them is reported as unbounded (None)."""
    a = (1.0 - conf) / 2.0
    xs = torch.sort(x.double()).values
    lo = float(torch.quantile(xs, a, interpolation="lower"))
    hi = float(torch.quantile(xs, 1.0 - a, interpolation="higher"))
    return [lo, hi]


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0; where den <= 0 the ratio is undefined and stands at +-inf (the sign
    of num; +inf for 0/0), so it lands in the tails of a percentile interval."""
    inf = torch.where(num < 0, -math.inf, math.inf).to(torch.float64)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), inf)


def mean_se(x: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n)) of a 1-D reward vector."""
    x = x.double()
    n = x.numel()
    return float(x.mean()), (float(x.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan"))


def gain_stats(base: torch.Tensor, full: torch.Tensor, cfg: BootstrapConfig) -> dict[str, Any]:
    """Base and full held-out rewards, their standard errors, and the gain with its bootstrap
    interval. base: (n,) per-prompt rewards; full: (S, n) per seed and prompt (same prompts)."""
    base, full = base.double(), full.double()
    S, n = full.shape
    if base.shape != (n,):
        raise ValueError(f"base: expected {n} per-prompt rewards, got {tuple(base.shape)}")
    d = _draws(S, n, cfg)["both"]
    bm, bse = mean_se(base)
    per_seed = full.mean(1)
    fm = float(per_seed.mean())
    # SE of the full mean: prompt noise of each seed's mean plus the spread between seeds.
    fse_prompts = math.sqrt(float(full.var(1, unbiased=True).mean()) / (n * S)) if n > 1 else float("nan")
    fb = d.runs(full)
    gb = fb - d.base(base)
    lo, hi = _quantiles(gb, cfg.confidence)
    return {
        "eval_prompts": n, "seeds": S,
        "base_reward": bm, "base_se": bse,
        "full_reward_mean": fm,
        "full_reward_std": float(per_seed.std(unbiased=True)) if S > 1 else 0.0,
        "full_rewards": per_seed.tolist(),
        "full_se": float(fb.std(unbiased=True)),
        "full_se_prompts": fse_prompts,
        "gain": fm - bm, "gain_se": float(gb.std(unbiased=True)), "gain_ci": [lo, hi],
        "gain_significant": lo > 0.0,
        "confidence": cfg.confidence, "bootstrap": cfg.replicates,
    }


def retention_row(
    base: torch.Tensor, full: torch.Tensor, masked: torch.Tensor, cfg: BootstrapConfig, valid: bool,
) -> dict[str, Any]:
    """Retention of one mask: masked (S, n) rewards paired with full (S, n) by seed and with base
    (n,) by prompt. Retention numbers are None unless `valid` (full training beat the base)."""
    base, full, masked = base.double(), full.double(), masked.double()
    if masked.shape != full.shape:
        raise ValueError(f"masked: expected shape {tuple(full.shape)} (seeds x prompts), got {tuple(masked.shape)}")
    S, _n = full.shape
    bm = float(base.mean())
    per_seed_m = masked.mean(1)
    per_seed_f = full.mean(1)
    mm = float(per_seed_m.mean())
    draws = _draws(S, base.numel(), cfg)
    both = draws["both"]
    m_b = both.runs(masked)
    row: dict[str, Any] = {
        "reward_mean": mm, "reward_std": float(per_seed_m.std(unbiased=True)) if S > 1 else 0.0,
        "rewards": per_seed_m.tolist(),
        "reward_ci": _quantiles(m_b, cfg.confidence),
        "reward_se": float(m_b.std(unbiased=True)),
        "retention": None, "retention_ci": None, "retention_ci_seeds": None, "retention_ci_prompts": None,
        "retentions": None, "retention_mean": None, "retention_std": None,
    }
    if not valid:
        return row
    row["retention"] = (mm - bm) / (float(per_seed_f.mean()) - bm)
    for name, key in (("both", "retention_ci"), ("seeds", "retention_ci_seeds"), ("prompts", "retention_ci_prompts")):
        d = draws[name]
        b_b = d.base(base)
        ci = _quantiles(_ratio(d.runs(masked) - b_b, d.runs(full) - b_b), cfg.confidence)
        row[key] = [_finite_or_none(ci[0]), _finite_or_none(ci[1])]
    # Paired per-seed retentions (same seed for full and masked), for the seed spread.
    rets = [retention(float(m), float(f), bm) for m, f in zip(per_seed_m, per_seed_f, strict=True)]
    row["retentions"] = [_finite_or_none(r) for r in rets]
    row["retention_mean"], row["retention_std"] = (_finite_or_none(x) for x in mean_std(rets))
    return row


def build_table(
    base: torch.Tensor,
    full: torch.Tensor,
    masked: dict[tuple[str, float], torch.Tensor],
    boot: BootstrapConfig | None = None,
    densities_actual: dict[tuple[str, float], float] | None = None,
) -> dict[str, Any]:
    """The retention table from per-prompt rewards: base (n,), full (S, n), masked[(sel, d)] (S, n)."""
    boot = boot or BootstrapConfig()
    table = gain_stats(base, full, boot)
    valid = table["gain_significant"]
    if not valid:
        lo, hi = table["gain_ci"]
        table["warning"] = (
            f"full training did not beat the base beyond its error: gain {table['gain']:+.4f} "
            f"({boot.confidence:.0%} CI {lo:+.4f} .. {hi:+.4f}; SE of base {table['base_se']:.4f}, "
            f"of full {table['full_se']:.4f}); no retention is reported. Train longer, evaluate "
            f"on more prompts (smaller eval_se) or use more seeds."
        )
    rows = []
    for (sel, dens), m in masked.items():
        rows.append({"selector": sel, "density": dens,
                     "actual_density": (densities_actual or {}).get((sel, dens), dens),
                     **retention_row(base, full, m, boot, valid)})
    table["retention_valid"] = valid
    table["rows"] = rows
    return table


def _fmt(x: Any, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _ci(ci: Any, nd: int = 2) -> str:
    if ci is None:
        return "n/a"
    return f"[{_fmt(ci[0], nd) if ci[0] is not None else '-inf'}, {_fmt(ci[1], nd) if ci[1] is not None else '+inf'}]"


def markdown_table(table: dict[str, Any]) -> str:
    """The retention table as GitHub markdown: rewards with their bootstrap intervals, retention
    (ratio of means) with intervals over seeds and prompts together and apart."""
    conf = f"{table.get('confidence', 0.95):.0%}"
    lo, hi = table["gain_ci"]
    lines = [
        f"base held-out reward {_fmt(table['base_reward'])} (SE {_fmt(table['base_se'])}, "
        f"{table['eval_prompts']} prompts); full training {_fmt(table['full_reward_mean'])} "
        f"(SE {_fmt(table['full_se'])}, {table['seeds']} seeds); gain {table['gain']:+.3f} "
        f"({conf} CI {lo:+.3f} .. {hi:+.3f})",
        "",
    ]
    if not table.get("retention_valid"):
        lines += [f"**WARNING: {table['warning']}**", ""]
    lines += [
        f"| selector | density | held-out reward [{conf} CI] | retention | {conf} CI (seeds+prompts) "
        "| CI seeds only | CI prompts only | per seed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table["rows"]:
        per_seed = ", ".join(_fmt(x, 2) for x in r["retentions"]) if r.get("retentions") else "n/a"
        lines.append(
            f"| {r['selector']} | {r['density']:g} | {_fmt(r['reward_mean'])} {_ci(r['reward_ci'], 3)} "
            f"| {_fmt(r['retention'], 2)} | {_ci(r['retention_ci'])} | {_ci(r['retention_ci_seeds'])} "
            f"| {_ci(r['retention_ci_prompts'])} | {per_seed} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# the grid
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetentionConfig:
    train: Any = field(metadata={"help": "compute.train.TrainConfig shared by every run (seed replaced)"})
    fisher: Any = field(metadata={"help": "compute.fisher.FisherConfig of the initial Fisher"})
    selectors: tuple[str, ...] = field(default=("fisher", "random"), metadata={"help": "mask selectors"})
    densities: tuple[float, ...] = field(default=(0.01, 0.05), metadata={"help": "mask densities"})
    seeds: int = field(default=3, metadata={"help": "paired seeds (each: one full + one run per mask)"})
    first_seed: int = field(default=0, metadata={"help": "seeds are first_seed .. first_seed + seeds - 1"})
    eval_prompts: int = field(default=2500, metadata={"help": "held-out prompts (same for every model)"})
    eval_max_new_tokens: int = field(default=8, metadata={"help": "greedy evaluation completion cap"})
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig, metadata={"help": "intervals"})

    def __post_init__(self) -> None:
        if not self.selectors:
            raise ValueError("selectors: need at least one mask selector")
        if not self.densities or not all(0.0 < d <= 1.0 for d in self.densities):
            raise ValueError(f"densities: got {list(self.densities)}; accepted range: > 0, <= 1")
        if self.seeds < 1:
            raise ValueError(f"seeds: got {self.seeds}; accepted range: >= 1")
        if self.eval_prompts < 2:
            raise ValueError(f"eval_prompts: got {self.eval_prompts}; accepted range: >= 2")

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    def plan(self) -> list[tuple[int, tuple[str, float] | None]]:
        """Every training run in order: (seed, None) for the full run, (seed, (selector, density))."""
        return [(s, key) for s in self.seed_list
                for key in [None, *((sel, d) for sel in self.selectors for d in self.densities)]]


def heldout_rewards(model: torch.nn.Module, tokenizer: Any, task: Any, n: int, max_new_tokens: int) -> torch.Tensor:
    """(n,) float64 per-prompt task reward of greedy completions on held-out prompts 0..n-1 of the
    test split (seed 0): the same prompts for every model, so comparisons are paired."""
    from compute.lm.causal_lm import greedy_generate

    examples = task.examples(n, seed=0, split="test")
    completions = greedy_generate(model, tokenizer, [e.prompt for e in examples], max_new_tokens)
    return torch.tensor([task.reward(c, e.answer) for c, e in zip(completions, examples, strict=True)],
                        dtype=torch.float64)


def arm_label(key: tuple[str, float] | None) -> str:
    """'full' or 'selector@density' (the name of an arm's rewards and curves)."""
    return "full" if key is None else f"{key[0]}@{key[1]:g}"


def with_seed(train_config: Any, seed: int) -> Any:
    """A copy of a TrainConfig with another seed (the paired seed of one arm)."""
    return type(train_config)(**{**train_config.__dict__, "seed": seed})


def train_arm(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    config: RetentionConfig,
    seed: int,
    mask: dict[str, torch.Tensor] | None = None,
    teacher: torch.nn.Module | None = None,
    progress: Callable[[float, str], None] | None = None,
    parts: dict[str, float] | None = None,
    lengths: list[dict[str, Any]] | None = None,
) -> tuple[torch.nn.Module, torch.Tensor, list[dict[str, float]]]:
    """One arm: a copy of `model` trained with the paired seed (full when mask is None), and its
    (n,) held-out rewards and per-step curve. The caller's model is not modified. `parts`, when
    given, gets the seconds of the training ("steps") and of the evaluation added; `lengths` the
    run's record of how long its sampled completions ran (TrainOutcome.completion_lengths)."""
    from compute.train import train

    t0 = time.perf_counter()
    m = copy.deepcopy(model)
    res = train(m, tokenizer, task, with_seed(config.train, seed), mask=mask, teacher=teacher,
                evaluate=False, progress=progress)
    t1 = time.perf_counter()
    rewards = heldout_rewards(m, tokenizer, task, config.eval_prompts, config.eval_max_new_tokens)
    if parts is not None:
        parts["steps"] = parts.get("steps", 0.0) + t1 - t0
        parts["evaluation"] = parts.get("evaluation", 0.0) + time.perf_counter() - t1
    if lengths is not None and res.completion_lengths is not None:
        lengths.append(res.completion_lengths)
    return m, rewards, res.curve


def grid_table(config: RetentionConfig, base: torch.Tensor, arms: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The retention table of a whole grid from its parts: base (n,) held-out rewards and one dict
    per arm, in plan order: seed, selector/density (None for full), rewards (n,), curve,
    actual_density (masked arms), update_sparsity and fisher (full arms). Arms are independent
    (each trained from the base with its own seed), so they may come from different processes."""
    full: dict[int, torch.Tensor] = {}
    masked: dict[tuple[str, float], dict[int, torch.Tensor]] = {}
    actual: dict[tuple[str, float], float] = {}
    full_sparsity: list[dict[str, Any]] = []
    curves: dict[str, list[list[dict[str, float]]]] = {}
    fisher_meta: dict[str, Any] = {}
    for arm in arms:
        key = None if arm["selector"] is None else (str(arm["selector"]), float(arm["density"]))
        curves.setdefault(arm_label(key), []).append(arm["curve"])
        if key is None:
            full[int(arm["seed"])] = arm["rewards"]
            full_sparsity.append(arm["update_sparsity"])
            fisher_meta = fisher_meta or dict(arm.get("fisher") or {})
        else:
            masked.setdefault(key, {})[int(arm["seed"])] = arm["rewards"]
            actual[key] = float(arm["actual_density"])
    seeds = config.seed_list
    missing = [s for s in seeds if s not in full]
    if missing:
        raise ValueError(f"arms: no full run for seeds {missing}; every seed needs one (paired seeds)")
    full_t = torch.stack([full[s] for s in seeds])  # (S, n)
    masked_t = {k: torch.stack([v[s] for s in seeds]) for k, v in masked.items()}
    table = build_table(base, full_t, masked_t, config.bootstrap, actual)
    keys = sorted({k for s in full_sparsity for k, v in s.items() if isinstance(v, (int, float))})
    table["full_update_sparsity"] = {k: mean_std([float(s[k]) for s in full_sparsity
                                                  if s.get(k) is not None])[0] for k in keys}
    table["full_update_sparsity_per_seed"] = full_sparsity
    table["fisher"] = {**fisher_meta, "prompts": config.fisher.prompts, "samples": config.fisher.samples}
    table["per_prompt_rewards"] = {
        "base": base.tolist(), "full": full_t.tolist(),
        **{arm_label(k): t.tolist() for k, t in masked_t.items()},
    }
    table["curves"] = curves
    table["runs"] = len(arms)
    table["seeds_used"] = seeds
    table["bootstrap_settings"] = asdict(config.bootstrap)
    return table
