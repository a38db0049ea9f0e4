"""Job `retention`: the fixed-mask retention grid of compute.studies.retention, run as independent units.

Units (child jobs when queued, so N workers run N units at once; compute.jobs.runners' protocol):

- unit 0 evaluates the base model on the held-out prompts (only `combine` needs it);
- unit 1 + i runs arm i of `RetentionConfig.plan()`: for seed s, the full run or one mask's run,
  with the same seed s for the full and every masked arm (paired seeds), evaluated on the same
  held-out prompts (paired prompts).

`combine` builds the table (compute.studies.retention.grid_table) from the units' outputs in index order;
`run` (the CLI and a job that is not fanned out) is `combine` over every unit run in this process.

Shared prerequisites. A unit may run on another machine, so each one is self-contained: it loads
the model itself and, when it needs the initial Fisher (full arms, for the update-sparsity AUCs, and
arms whose mask is chosen from the Fisher), estimates it itself with the fixed seed 0. The estimate
is deterministic (per-row sampling seeds, compute.lm.sampling), so every unit gets the same Fisher and
the same Fisher masks (bit for bit on one machine; tests check it). The Fisher is not a first unit
of its own because every arm would then wait for it (or ship model-sized tensors to `combine`),
and it is cheap next to an arm: `fisher_prompts x fisher_samples` sampled completions with one
backward each (256 at the defaults) against `steps x batch x group` completions per arm (12,800).
In one process, `shared` (a dict handed to every `run_child`) keeps the loaded models, the Fisher and
the seed-independent masks, so `run` computes each once.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from compute.contract.cost import merge_length_records
from compute.contract.jobresult import Heatmap, JobResult, SeriesPoint, null_progress
from compute.contract.kinds import Refs
from compute.contract.results import sum_parts
from compute.jobs.retention import DEFAULT_TEACHERS, RetentionSpec

SMALL_MODEL_PARAMS = 20_000_000  # below this, CPU runs use one torch thread
FISHER_SEED = 0  # sampling seed of the initial Fisher: the same in every unit


def teacher_ref(spec: RetentionSpec) -> str | None:
    if spec.algo != "opd":
        return spec.teacher
    ref = spec.teacher or DEFAULT_TEACHERS.get(spec.model)
    if not ref:
        raise ValueError("teacher: algo 'opd' needs a teacher model for this --model")
    return ref


def retention_config(spec: RetentionSpec) -> Any:
    """The compute.studies.retention.RetentionConfig of a spec (training seed replaced per arm)."""
    from compute.fisher import FisherConfig
    from compute.jobs.train_run import config_from_spec
    from compute.studies.retention import BootstrapConfig, RetentionConfig

    config = config_from_spec(spec, seed=0, steps=spec.steps, kl_coef=spec.kl_coef)
    fcfg = FisherConfig(prompts=spec.fisher_prompts, samples=spec.fisher_samples,
                        max_new_tokens=spec.max_new_tokens, seed=FISHER_SEED, device=spec.device)
    return RetentionConfig(
        train=config, fisher=fcfg,
        selectors=tuple(dict.fromkeys(spec.selectors)),
        densities=tuple(sorted(set(float(d) for d in spec.densities))),
        seeds=spec.seeds, eval_prompts=spec.eval_prompts,
        eval_max_new_tokens=config.eval_max_new_tokens,
        bootstrap=BootstrapConfig(replicates=spec.bootstrap, confidence=spec.confidence),
    )


def children(spec: RetentionSpec) -> int:
    """Units of the grid: the base evaluation and one per arm (seeds x (1 + selectors x densities))."""
    return 1 + len(retention_config(spec).plan())


@dataclass
class _Loaded:
    model: Any
    tokenizer: Any
    task: Any
    teacher: Any
    config: Any
    small: bool


def _load(spec: RetentionSpec, shared: dict[Any, Any], progress: Any, refs: Refs | None = None) -> _Loaded:
    if "loaded" in shared:
        return shared["loaded"]
    import torch

    from compute.jobs.artifact_files import resolved_refs
    from compute.lm.causal_lm import load_model, resolve_device
    from compute.lm.verifiable_tasks import get_task
    from compute.train.objectives.distill import check_same_tokenizer

    device = resolve_device(spec.device)
    torch.manual_seed(0)
    progress(0.0, f"loading {spec.model}")
    model_ref = resolved_refs(spec, refs).get("model")
    assert model_ref is not None  # the spec requires a model
    model, tok = load_model(model_ref, device=device, dtype=spec.dtype)
    teacher = None
    if spec.algo == "opd":
        teacher_ref_ = resolved_refs(spec, refs).get("teacher")  # the resolver resolved the default teacher too
        assert teacher_ref_ is not None
        teacher, ttok = load_model(teacher_ref_, device=device, dtype=spec.dtype)
        check_same_tokenizer(tok, ttok)
    # A model this small runs several times faster on one CPU thread (measured on arith-base:
    # 100 GRPO steps in ~10 s on 1 thread, ~40 s on 2), and results are the same.
    small = device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS
    shared["loaded"] = _Loaded(model, tok, get_task(spec.task), teacher, retention_config(spec), small)
    return shared["loaded"]


@contextlib.contextmanager
def _threads(one: bool) -> Iterator[int]:
    import torch

    before = torch.get_num_threads()
    if one:
        torch.set_num_threads(1)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _fisher(lo: _Loaded, shared: dict[Any, Any], progress: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The initial Fisher (seed FISHER_SEED) and its description, estimated once per `shared`."""
    if "fisher" not in shared:
        from compute.fisher import estimate_fisher

        progress(0.0, "initial Fisher")
        t0 = time.perf_counter()
        fr = estimate_fisher(lo.model, lo.tokenizer, lo.task, lo.config.fisher)
        shared["fisher"] = (fr.fisher, {"estimator": fr.estimator, "rows": fr.n_rows, "tokens": fr.n_tokens})
        shared["fisher_seconds"] = time.perf_counter() - t0  # the unit that made it reports it
    return shared["fisher"]


def _mask(lo: _Loaded, shared: dict[Any, Any], key: tuple[str, float], seed: int,
          progress: Any) -> tuple[Any, float]:
    """The mask of one arm and its actual density; seed-independent masks built once per `shared`."""
    from compute.contract.specs import FISHER_SELECTORS
    from compute.jobs.train_run import build_mask_in_memory
    from compute.studies.retention import SEED_DEPENDENT, with_seed

    sel, dens = key
    cache_key = ("mask", sel, dens, seed if sel in SEED_DEPENDENT else -1)
    if cache_key not in shared:
        fisher = _fisher(lo, shared, progress)[0] if sel in FISHER_SELECTORS else None
        mask, info = build_mask_in_memory(lo.model, lo.tokenizer, lo.task, sel, dens, seed, fisher=fisher,
                                          gradient_config=with_seed(lo.config.train, seed), teacher=lo.teacher)
        shared[cache_key] = (mask, float(info["actual_density"]))
    return shared[cache_key]


def run_child(spec: RetentionSpec, index: int, progress: Any = null_progress,
              shared: dict[Any, Any] | None = None, refs: Refs | None = None) -> dict[str, Any]:
    """One unit: 0 -> {"base": (n,) rewards}; 1 + i -> arm i (seed, selector, density, rewards,
    curve, actual_density; full arms also update_sparsity and the Fisher's description).
    `shared`: prerequisites kept between units of one process (see the module docstring)."""
    import torch

    from compute.jobs.train_run import update_sparsity
    from compute.studies.retention import arm_label, heldout_rewards, train_arm

    t0 = time.perf_counter()
    shared = {} if shared is None else shared
    # where the unit's time went, by the names of the kind's estimate (retention.timing): the
    # load and the Fisher in the unit that made them, the masks, the steps, the evaluations, a
    # full arm's update sparsity ("finish")
    parts: dict[str, float] = {}
    fresh = "loaded" not in shared
    lo = _load(spec, shared, progress, refs)
    if fresh:
        parts["load"] = time.perf_counter() - t0
    plan = lo.config.plan()
    if not 0 <= index <= len(plan):
        raise ValueError(f"index: got {index}; accepted range: 0 .. {len(plan)}")
    with _threads(lo.small) as threads:
        torch.manual_seed(0)  # each unit alike, whatever ran before it in this process
        if index == 0:
            progress(0.0, "base accuracy")
            t = time.perf_counter()
            base = heldout_rewards(lo.model, lo.tokenizer, lo.task, lo.config.eval_prompts,
                                   lo.config.eval_max_new_tokens)
            parts["evaluation"] = time.perf_counter() - t
            return {"base": base, "torch_threads": threads, "seconds": time.perf_counter() - t0,
                    "seconds_parts": parts}
        seed, key = plan[index - 1]
        label = f"seed {seed} {arm_label(key)}"
        t, had_fisher = time.perf_counter(), "fisher" in shared
        mask, actual = (None, None) if key is None else _mask(lo, shared, key, seed, progress)
        fisher, info = _fisher(lo, shared, progress) if key is None else (None, None)
        fisher_s = 0.0 if had_fisher or "fisher" not in shared else float(shared["fisher_seconds"])
        if fisher_s:
            parts["initial Fisher"] = fisher_s
        if key is not None:
            parts["masks"] = time.perf_counter() - t - fisher_s

        def arm_progress(f: float, msg: str = "") -> None:
            progress(f, f"{label}: {msg}")

        lengths: list[dict[str, Any]] = []
        m, rewards, curve = train_arm(lo.model, lo.tokenizer, lo.task, lo.config, seed, mask, lo.teacher,
                                      progress=arm_progress, parts=parts, lengths=lengths)
        out: dict[str, Any] = {"seed": seed, "selector": None if key is None else key[0],
                               "density": None if key is None else key[1], "rewards": rewards,
                               "curve": curve, "actual_density": actual, "torch_threads": threads,
                               "completion_lengths": lengths[0] if lengths else None}
        if key is None:
            t = time.perf_counter()
            base_sd = {n: p.detach().cpu() for n, p in lo.model.named_parameters()}
            out["update_sparsity"] = update_sparsity(base_sd, m, fisher)
            out["fisher"] = info
            parts["finish"] = time.perf_counter() - t
        out["seconds"] = time.perf_counter() - t0
        out["seconds_parts"] = parts
        return out


def _sub_progress(progress: Any, i: int, n: int) -> Any:
    def sub(f: float, m: str = "") -> None:
        progress((i + min(max(f, 0.0), 1.0)) / n, m)

    return sub


def run(spec: RetentionSpec, progress: Any = null_progress, refs: Refs | None = None) -> JobResult:
    """The whole grid in this process: `combine` over every unit, prerequisites shared."""
    n = children(spec)
    shared: dict[Any, Any] = {}
    outputs = [run_child(spec, i, _sub_progress(progress, i, n), shared, refs) for i in range(n)]
    return combine(spec, outputs, progress)


def _series(table: dict[str, Any], curves: dict[str, Any]) -> list[SeriesPoint]:
    series = []
    for r in table["rows"]:
        if r["retention"] is not None:
            series.append(SeriesPoint(f"retention/{r['selector']}", r["density"], r["retention"]))
        series.append(SeriesPoint(f"heldout/{r['selector']}", r["density"], r["reward_mean"]))
    for label, runs in curves.items():  # per-step sample reward, averaged over seeds
        steps = max(len(c) for c in runs)
        for i in range(steps):
            vals = [c[i]["reward"] for c in runs if i < len(c) and "reward" in c[i]]
            if vals:
                series.append(SeriesPoint(f"train_reward/{label}", i + 1, sum(vals) / len(vals)))
    return series


def combine(spec: RetentionSpec, outputs: list[Any], progress: Any = null_progress,
            refs: Refs | None = None) -> JobResult:
    """The retention JobResult from every unit's output, in index order (see `run_child`)."""
    import torch

    from compute.studies.retention import grid_table, markdown_table

    rcfg = retention_config(spec)
    if len(outputs) != 1 + len(rcfg.plan()):
        raise ValueError(f"outputs: got {len(outputs)} units; the grid has {1 + len(rcfg.plan())}")
    progress(0.99, "bootstrap intervals")
    table = grid_table(rcfg, outputs[0]["base"], outputs[1:])
    table["markdown"] = markdown_table(table)
    table["seconds"] = round(sum(float(o["seconds"]) for o in outputs), 1)
    table["seconds_parts"] = sum_parts(outputs)
    lengths = merge_length_records([o["completion_lengths"] for o in outputs[1:] if o.get("completion_lengths")])
    curves = table.pop("curves")
    per_prompt = table.pop("per_prompt_rewards")  # (S, n) lists: an artifact, not a summary field
    summary: dict[str, Any] = {
        "model": spec.model, "task": spec.task, "algo": spec.algo, "teacher": teacher_ref(spec),
        "settings": {**rcfg.train.__dict__, "seeds": spec.seeds, "selectors": list(rcfg.selectors),
                     "densities": list(rcfg.densities), "fisher": rcfg.fisher.__dict__,
                     "torch_threads": int(outputs[0]["torch_threads"]), "units": len(outputs)},
        "seconds_note": "sum of the units' times (less wall time when workers run units in parallel)",
        "eval": {"split": "test", "prompts": spec.eval_prompts, "eval_se_target": spec.eval_se,
                 "decoding": "greedy", "max_new_tokens": rcfg.eval_max_new_tokens,
                 "reward": "task reward of each held-out prompt (accuracy), the same prompts for every model"},
        **table,
        # issue 18: the training precision of every run (TrainConfig.precision)
        "compute_dtype": "bfloat16" if rcfg.train.precision == "bf16" else "float32",
        "stored_dtype": "float32",  # the per-prompt rewards artifact
    }
    if lengths is not None:  # every arm's sampled completions (the base's greedy evaluation samples none)
        summary["completion_lengths"] = lengths
    z = [[next((r["retention"] for r in table["rows"]
                if r["selector"] == s and r["density"] == d), None) for d in rcfg.densities]
         for s in rcfg.selectors]
    z = [[None if v is None or math.isnan(v) else v for v in row] for row in z]
    value = ("retention (ratio of means over seeds and prompts)" if table["retention_valid"]
             else "no retention: full training did not beat the base beyond its error")
    heat = Heatmap("retention", [f"{d:g}" for d in rcfg.densities], list(rcfg.selectors), z,
                   meta={"x": "density", "y": "selector", "value": value})
    rewards = {k: torch.tensor(v, dtype=torch.float32) for k, v in per_prompt.items()}
    progress(1.0, "done")
    return JobResult(kind="retention", summary=summary, heatmaps=[heat], series=_series(table, curves),
                     tensors={"rewards": rewards})
