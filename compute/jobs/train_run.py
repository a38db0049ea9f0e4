"""Job `train`: one post-training run (GRPO, OPD or SFT), full or masked, on a model.

The trained model (HF format, with its tokenizer and metrics.json) is written to a fresh temp
folder whose path is JobResult.files["model"]; the worker (or the CLI) moves it.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compute.contract.jobresult import JobResult, SeriesPoint, null_progress
from compute.contract.kinds import Ref, Refs
from compute.contract.specs import FISHER_SELECTORS
from compute.fisher.precision import float32_weights
from compute.jobs.artifact_files import resolved_refs
from compute.jobs.train import TrainSpec, needs_initial_fisher
from compute.runtime.memory import mmap_threshold_fixed, release_freed_memory
from compute.sparsity.masks import CompactMask


def config_from_spec(spec: Any, seed: int | None = None, **over: Any) -> Any:
    """compute.train.TrainConfig of a spec (TrainSpec, RetentionSpec, ...), seed and `over` replaced."""
    from compute.train import TrainConfig

    return TrainConfig.from_spec(spec, **({} if seed is None else {"seed": seed}), **over)


def build_mask_in_memory(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    selector: str,
    density: float,
    seed: int,
    fisher: Mapping[str, torch.Tensor] | None = None,
    fisher_config: Any = None,
    gradient_config: Any = None,
    teacher: torch.nn.Module | None = None,
    progress: Any = null_progress,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A mask of `model` by selector at density; estimates the Fisher when one is needed and not
    given (sequence estimator, fisher_config), or the |gradient| of the training objective."""
    from compute.sparsity.masks import mask_density, select_mask

    info: dict[str, Any] = {"select": selector, "density": density, "seed": seed}
    if selector in FISHER_SELECTORS:
        if fisher is None:
            from compute.fisher import estimate_fisher

            progress(0.0, "estimating the Fisher for the mask")
            est = estimate_fisher(model, tokenizer, task, fisher_config)
            fisher = est.fisher
            info["fisher"] = {"prompts": fisher_config.prompts, "samples": fisher_config.samples,
                              "estimator": fisher_config.estimator}
            if est.halves is not None:  # issue 18: the verdict of the Fisher the mask is built on
                from compute.contract.results import reliability_level
                from compute.fisher.statistics import topk_jaccard

                jac = topk_jaccard(est.halves.view(0), est.halves.view(1), 1.0)  # a slice at a time
                info["fisher"].update(split_half_jaccard=jac, split_half_topk_percent=1.0,
                                      reliability=reliability_level(jac))
        mask = select_mask(selector, density, scores=dict(fisher), params=model, seed=seed)
    elif selector == "gradient":
        from compute.train import objective_gradient

        progress(0.0, "gradient of the training objective")
        grads = objective_gradient(model, tokenizer, task, gradient_config, teacher)
        info["scores"] = "|gradient| of the training objective on the first batch"
        mask = select_mask(selector, density, scores=grads, params=model, seed=seed)
    else:  # random, magnitude, magnitude-bottom
        mask = select_mask(selector, density, params=model, seed=seed)
    dev = next(model.parameters()).device
    mask = {n: m.to(dev) for n, m in mask.items()}
    info["actual_density"] = mask_density(mask)
    return mask, info


def update_sparsity(
    base: Any, tuned: Any,
    fisher: Mapping[str, torch.Tensor] | None = None, within: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Global update-sparsity numbers of a run (compute.sparsity.diff) and, with a Fisher, its precision@k
    against the changed / top-|delta| coordinates and its AUC for "changed" within |w| binades.
    base, tuned: state dicts or sources read a tensor at a time (ModelStored, FileBase); tuned may
    be the model (compare like with like: both in the stored dtype).
    within: the mask the run trained inside: the Fisher metrics over its coordinates only
    (compute.contract.construction)."""
    from compute.sparsity.diff import diff_checkpoints

    tuned_src: Any
    if isinstance(tuned, torch.nn.Module):
        tuned_src = {n: p.detach().cpu() for n, p in tuned.named_parameters()}
    else:
        tuned_src = tuned if hasattr(tuned, "names") and not isinstance(tuned, Mapping) else dict(tuned)
    names = set(tuned_src.names() if hasattr(tuned_src, "names") else tuned_src)
    if fisher is not None:
        fisher = {n: f for n, f in fisher.items() if n in names}
    base_src = base if hasattr(base, "names") and not isinstance(base, Mapping) else dict(base)
    d = diff_checkpoints(base_src, tuned_src, fisher=fisher, svd_max_numel=0, within=within)
    glob = next(iter(d.groups["global"].values()))
    out: dict[str, Any] = {k: v for k, v in glob.items()
                           if k.startswith(("unchanged_", "changed_")) or k == "zero_in_base"}
    if d.fisher is not None:
        g = d.fisher.get("global", {})
        allm = next(iter(g.values())) if g else {}
        out["fisher_precision_at_top1pct_delta"] = allm.get("precision_at_k")
        out["fisher_auc_top1pct_delta"] = allm.get("auc")
        out["fisher_precision_at_changed"] = d.fisher.get("changed", {}).get("precision_at_n_changed")
        out["fisher_auc_changed"] = d.fisher.get("changed", {}).get("auc")
        out["fisher_auc_changed_within_binades"] = d.fisher.get("changed_by_weight_binade", {}).get("pooled_auc")
        out["fisher_auc_changed_by_binade"] = d.fisher.get("changed_by_weight_binade", {}).get("bins")
    return out


class ModelStored:
    """The model's parameters as its checkpoint stores them at `precision`, one tensor at a time
    (the diff's source interface: names, shape, dtype, get), no copy of the model."""

    def __init__(self, model: torch.nn.Module, precision: str):
        from compute.train import stored_dtype

        self.params = dict(model.named_parameters())
        self.dt = stored_dtype(precision)

    def names(self) -> list[str]:
        return sorted(self.params)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.params[name].shape)

    def dtype(self, name: str) -> str:
        return str(self.dt).replace("torch.", "")

    def get(self, name: str) -> torch.Tensor:
        return self.params[name].detach().to(device="cpu", dtype=self.dt)


class FileBase(ModelStored):
    """The base of a run read back from its model file, tensor by tensor, as the loaded and
    prepared weights were (cast to the loaded dtype, then to the training precision, then to the
    stored dtype): the "unchanged" report and |delta| compare against it, so the job keeps no
    second copy of the model (issue 30)."""

    def __init__(self, model: torch.nn.Module, checkpoint: Any, base_dtype: str, precision: str):
        super().__init__(model, precision)
        self.ckpt, self.loaded = checkpoint, getattr(torch, base_dtype)
        self.precision = precision

    def get(self, name: str) -> torch.Tensor:
        return self._prepared(self.ckpt.get(name))

    def _prepared(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.loaded)
        if self.precision == "bf16-mixed":
            t = t.to(torch.bfloat16).to(torch.float32)
        elif self.precision == "bf16":
            t = t.to(torch.bfloat16)
        else:
            t = t.to(torch.float32)
        return t.to(self.dt)

    def lazy(self, name: str) -> Any:
        """The same values read a slice of rows at a time (compute.sparsity.diff.LazyTensor):
        the diff after training holds a slice of the base's largest tensor, not all of it."""
        from compute.sparsity.diff import LazyTensor

        return LazyTensor(self.ckpt, name, self.dt, self._prepared)

    def matches_model(self) -> bool:
        """Every parameter read back from the file equals the loaded and prepared one bit for bit,
        compared a slice of rows at a time (DIFF_CHUNK values): the check holds a slice of the
        largest tensor, not the tensor (issue 30: the whole read was the 20M masked job's peak)."""
        from compute.sparsity.diff import DIFF_CHUNK

        names = set(self.ckpt.names())
        if not all(n in names and self.ckpt.shape(n) == self.shape(n) for n in self.names()):
            return False
        for n in self.names():
            base, own = self.lazy(n), self.params[n].detach().reshape(-1)
            for i in range(0, base.numel(), DIFF_CHUNK):
                j = min(i + DIFF_CHUNK, base.numel())
                if not torch.equal(base.flat(i, j), own[i:j].to(device="cpu", dtype=self.dt)):
                    return False
        return True


def base_source(model: torch.nn.Module, model_ref: Any, base_dtype: str, precision: str) -> Any:
    """The run's base in its stored dtype for the comparisons after training: a FileBase when the
    model's checkpoint file gives back every parameter bit for bit (checked now, tensor by tensor,
    before any step), else a copy in memory (compute.train.stored_state)."""
    from compute.train import stored_state

    try:
        from compute.sparsity.diff import open_checkpoint

        src = FileBase(model, open_checkpoint(model_ref, "model"), base_dtype, precision)
        if src.matches_model():
            return src
    except (ValueError, OSError, AttributeError, KeyError, TypeError):
        pass  # no readable checkpoint of this model (e.g. built in memory): keep a copy
    return stored_state(model, precision)


def _headline_convention(us: dict[str, Any], base_dtype: str, stored_dtype: str) -> None:
    """The headline policy (compute.contract.precision) for a run's update sparsity: the base was
    cast to the checkpoint's stored dtype before the comparison (stored_state), i.e. both sides are
    in the lower of the two precisions, so the exact count of that comparison is the policy's
    "unchanged"; the convention records the base's own dtype so the headline says so."""
    from compute.contract.precision import comparison

    c = comparison({base_dtype}, {stored_dtype}, sides=("base", "checkpoint"))
    us["unchanged_common"] = us.get("unchanged_exact")
    us["comparison"] = c["comparison"]
    us["comparison_dtype"] = c["comparison_dtype"]
    us["comparison_rule"] = c["rule"]
    us["stored_dtypes"] = c["stored_dtypes"]


def _load(ref: Ref | str, spec: Any) -> tuple[Any, Any]:
    from compute.lm.causal_lm import load_model, resolve_device

    return load_model(ref, device=resolve_device(spec.device), dtype=getattr(spec, "dtype", "auto"))


INDEPENDENT_SEED_OFFSET = 777_767  # sampling seed offset of the independent Fisher's completions


def independent_fisher(
    model: torch.nn.Module, tokenizer: Any, task: Any, spec: Any,
    progress: Any = null_progress,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The initial (sequence) Fisher from samples independent of the training batches.

    'other-prompts': train-split prompts after the last one training uses (start = steps * batch);
    'other-completions': the first training prompts, completions sampled with another seed.
    Same completion length cap and temperature as training (the bound compares like with like).
    """
    from compute.fisher import FisherConfig, estimate_fisher

    mode = spec.independent_fisher
    start = spec.steps * spec.batch if mode == "other-prompts" else 0
    seed = spec.seed * 1_000_003 + INDEPENDENT_SEED_OFFSET
    examples = task.examples(spec.fisher_prompts, seed=spec.seed, split="train", start=start)
    cfg = FisherConfig(prompts=spec.fisher_prompts, samples=spec.fisher_samples,
                       max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, seed=seed,
                       prompt_start=start, device=spec.device)
    fr = estimate_fisher(model, tokenizer, examples, cfg, progress)
    info = {"source": mode, "estimator": "sequence", "prompts": spec.fisher_prompts,
            "samples": spec.fisher_samples, "prompt_start": start, "sampling_seed": seed,
            "n_samples": fr.n_samples, "note": "estimated from samples independent of the gradient"}
    return {n: f.float().cpu() for n, f in fr.fisher.items()}, info


TARGET_NAMES = {"grad_sq_sum": "the run's summed squared gradient (top-k)",
                "grad_abs_sum": "the run's summed |gradient| (top-k)",
                "abs_delta": "the run's |weight change| (top-k)"}


def _concentration_heatmaps(conc: dict[str, Any], scope: str | None = None) -> list[Any]:
    """The concentration AUC per layer x module; `scope` (compute.contract.construction) names the
    coordinates it is computed over in the title (inside the mask of a masked run)."""
    from compute.contract.jobresult import Heatmap
    from compute.lm.naming import layer_sort_key

    out = []
    for label in ("grad_sq_sum", "grad_abs_sum", "abs_delta"):
        cells = conc.get(label, {}).get("layer_module")
        if not cells:
            continue
        layers = sorted({k.split("/")[0] for k in cells}, key=layer_sort_key)
        mods: list[str] = []
        for k in cells:
            if k.split("/")[1] not in mods:
                mods.append(k.split("/")[1])
        z = [[_finite(cells[f"{lay}/{m}"]["auc"]) if f"{lay}/{m}" in cells else None for m in mods]
             for lay in layers]
        out.append(Heatmap(name=f"concentration_auc_{label}", x_labels=mods, y_labels=layers, z=z,
                           meta={"x_title": "module type", "y_title": "layer", "units": "ROC-AUC",
                                 "target": label, "topk_fraction": conc["fraction"], "zmin": 0.0,
                                 "zmax": 1.0,
                                 **({"title": f"Initial Fisher as a predictor of {TARGET_NAMES[label]}: "
                                              f"ROC-AUC ({scope})", "scope": scope} if scope else {})}))
    return out


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def concentration_summary(conc: dict[str, Any]) -> dict[str, Any]:
    """Headline rows of compute.sparsity.overlap.concentration: global, per layer, per module, per target."""
    keys = ("precision_at_k", "auc", "spearman", "jaccard_lift")
    out: dict[str, Any] = {"fraction": conc["fraction"]}
    for label in ("grad_sq_sum", "grad_abs_sum", "abs_delta"):
        if label not in conc:
            continue
        r = conc[label]
        out[label] = {
            "global": {k: r["global"]["all"][k] for k in keys},
            "layer": {g: {k: m[k] for k in keys} for g, m in r["layer"].items()},
            "module": {g: {k: m[k] for k in keys} for g, m in r["module"].items()},
        }
    return out


def run(spec: TrainSpec, progress: Any = null_progress, refs: Refs | None = None) -> JobResult:
    return train_job(spec, progress, refs=refs)


def train_job(
    spec: TrainSpec, progress: Any = null_progress,
    fisher: Mapping[str, torch.Tensor] | None = None, fisher_info: Mapping[str, Any] | None = None,
    refs: Refs | None = None,
) -> JobResult:
    """One training run (`_train_job`) with glibc's mmap threshold fixed at 1 MiB for its
    duration only (mmap_threshold_fixed): a worker runs its jobs in one process, and the next job
    (a Fisher's statistics slices) must not inherit it."""
    with mmap_threshold_fixed():
        return _train_job(spec, progress, fisher, fisher_info, refs)


def _train_job(
    spec: TrainSpec, progress: Any = null_progress,
    fisher: Mapping[str, torch.Tensor] | None = None, fisher_info: Mapping[str, Any] | None = None,
    refs: Refs | None = None,
) -> JobResult:
    """One training run (the `train` job). fisher/fisher_info: an initial Fisher already estimated
    (e.g. once for a whole sweep) instead of spec.fisher or a fresh independent estimate.
    refs: the resolved model / teacher / mask / fisher (compute/jobs/runners.py).
    The spec's cross-field rules (mask xor mask_select, opd teacher, dtype vs precision) hold by
    construction (compute.contract.specs.TrainSpec)."""

    from compute.train import save_checkpoint, save_output, train

    # where the job's time went, by the names of its estimate's parts (compute.jobs.train.timing:
    # load, initial Fisher, bound check, steps, evaluation, finish), as the Fisher job says its
    # own (issue 30: time against the estimate and the floor, measured, for every kind)
    clock = _Clock()
    run = _start(spec, progress, refs)
    clock.lap("load")
    out = Path(tempfile.mkdtemp(prefix="fisherlens-train-")) / "model"

    def save_every(step: int, model: Any, curve: list[dict[str, float]]) -> None:  # --save-steps
        if step % spec.save_steps == 0 or step == spec.steps:
            save_checkpoint(model, run.tok, out, step, curve, spec.steps, spec.save_steps, spec.precision)

    model = run.model
    mask = _mask(run)
    # a mask chosen here by a Fisher estimates one; any other mask is read or made with the load
    clock.lap("initial Fisher" if spec.mask_select in FISHER_SELECTORS else "load")
    # the Fisher and the bound in float32 when the weights are bf16: the model itself widened in
    # place for them and narrowed back bit for bit (its own values, exact both ways), not a float32
    # twin beside it (issue 30: 6 bytes/param where the estimate counts 4; 16 GB more at 8B)
    with float32_weights(model, from_checkpoint=False) if spec.precision == "bf16" else nullcontext():
        # GRPO's bound check, asked before the initial Fisher is made: one that will not fit needs none
        plan = _bound_plan(model, fisher) if spec.algo == "grpo" and spec.bound else None
        bound_skip = plan.skip if plan is not None else None
        if bound_skip is not None:
            run.summary["bound_skipped"] = bound_skip
        had = fisher is not None
        fisher, fisher_info = _initial_fisher(run, model, fisher, fisher_info, bound=bound_skip is None)
        # a part the estimate has only when the run makes a Fisher (timing: none given, and the
        # concentration or the bound needs one); a given Fisher's reading is the load's
        clock.lap("initial Fisher" if fisher is not None and not had else "load")
        if plan is not None and bound_skip is None:
            _bound(run, model, fisher, fisher_info, plan)
            clock.lap("bound check")
    # the base as the checkpoint stores it, for "unchanged" and |delta|: read from the model's
    # file tensor by tensor when that reproduces the loaded weights exactly, else a copy
    stored_base = base_source(model, resolved_refs(spec, refs)["model"], run.summary["base_dtype"],
                              spec.precision)
    release_freed_memory()  # the per-tensor reads of the base check
    run.summary["base_compared_from"] = "file" if isinstance(stored_base, FileBase) else "memory"
    clock.lap("finish")  # the base's check against its file
    res = train(model, run.tok, run.task, run.config, mask=mask, teacher=run.teacher,
                progress=lambda f, m="": progress(0.15 + 0.75 * f, m), step_hook=save_every if spec.save_steps else None)
    trained = clock.lap(None)  # the loop's time: its steps and its evaluations (res.eval_seconds)
    clock.add("steps", max(0.0, trained - res.eval_seconds))
    clock.add("evaluation", min(res.eval_seconds, trained))
    release_freed_memory()  # the run's activations and temporaries, before the diff
    progress(0.92, "update sparsity")
    _record_run(run, res)
    construction = _construction(run, mask, fisher_info)
    run.summary["update_sparsity"] = update_sparsity(stored_base, ModelStored(model, spec.precision), fisher,
                                                     within=mask)
    release_freed_memory()  # the diff's per-tensor reads and temporaries
    run.summary["update_sparsity"]["stored_dtype"] = res.settings["stored_dtype"]
    _headline_convention(run.summary["update_sparsity"], run.summary["base_dtype"], res.settings["stored_dtype"])
    # issue 18: the precision the run computed in and its checkpoint is stored in
    run.summary["compute_dtype"] = "bfloat16" if spec.precision == "bf16" else "float32"
    run.summary["stored_dtype"] = res.settings["stored_dtype"]
    if spec.concentration and res.grad_sq_sum is not None and res.grad_abs_sum is not None:
        progress(0.95, "gradient concentration")
        _concentration(run, res, fisher, stored_base, mask)
    metrics = train_metrics(res.curve, run.summary, spec, refs)
    save_output(model, run.tok, out, metrics, precision=spec.precision)
    if mask is not None:  # the mask travels with the model and its checkpoints (diff, series)
        _save_trained_mask(run, mask, out, construction)
    if mask is not None and spec.mask_select:  # the mask built here is an artifact of the job:
        # made dense now, after the run (the job held it compact until here)
        run.result.tensors["mask"] = {n: mask[n].cpu() for n in mask}
    run.result.files["model"] = str(out)
    clock.lap("finish")  # update sparsity, concentration, the model saved
    run.summary["seconds_parts"] = clock.parts()
    progress(1.0, f"accuracy {res.accuracy_before:.3f} -> {res.accuracy_after:.3f}")
    return run.result


class _Clock:
    """Seconds by part, each lap added to the part it names (parts in first-seen order)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self._parts: dict[str, float] = {}

    def lap(self, part: str | None) -> float:
        now = time.perf_counter()
        took, self.t = now - self.t, now
        if part is not None:
            self.add(part, took)
        return took

    def add(self, part: str, seconds: float) -> None:
        self._parts[part] = self._parts.get(part, 0.0) + seconds

    def parts(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self._parts.items()}


def train_metrics(curve: list[dict[str, float]], summary: Mapping[str, Any], spec: TrainSpec,
                  refs: Refs | None) -> dict[str, Any]:
    """The trained model's metrics.json: the curve, the summary and the spec, its references
    (model, teacher, mask, fisher) named by label, never by server path, and listed under
    "references" with the sha256 each was resolved with (compute.contract.provenance): the
    folder is an artifact a share link downloads."""
    from compute.contract.provenance import labelled, references

    metrics = {"curve": curve, **summary, "spec": spec.model_dump(mode="json")}
    out = labelled(metrics, refs)
    out["references"] = references(refs)
    return out


@dataclass
class _Run:
    """What the phases of one train job share."""

    spec: TrainSpec
    progress: Any
    model: Any
    tok: Any
    task: Any
    teacher: Any
    config: Any
    result: JobResult
    refs: Refs | None = None

    @property
    def summary(self) -> dict[str, Any]:
        return self.result.summary


def _start(spec: TrainSpec, progress: Any, refs: Refs | None = None) -> _Run:
    """Load the task, the model at the training precision and (opd) the teacher."""
    from compute.lm.verifiable_tasks import get_task
    from compute.train import prepare_precision
    from compute.train.objectives.distill import check_same_tokenizer

    task = get_task(spec.task)
    torch.manual_seed(spec.seed)
    progress(0.0, f"loading {spec.model}")
    model_ref = resolved_refs(spec, refs).get("model")
    assert model_ref is not None  # the spec requires a model
    model, tok = _load(model_ref, spec)
    base_dtype = str(next(model.parameters()).dtype).replace("torch.", "")  # the base as loaded
    prepare_precision(model, spec.precision)
    teacher = None
    if spec.algo == "opd":
        teacher_ref = resolved_refs(spec, refs).get("teacher")
        assert teacher_ref is not None  # TrainSpec: opd needs a teacher
        teacher, ttok = _load(teacher_ref, spec)
        check_same_tokenizer(tok, ttok)
    config = config_from_spec(spec, track_gradients=spec.concentration)
    summary = {"model": spec.model, "task": spec.task, "algo": spec.algo, "precision": spec.precision,
               "base_dtype": base_dtype}
    return _Run(spec, progress, model, tok, task, teacher, config, JobResult(kind="train", summary=summary),
                refs)


def _mask(run: _Run) -> CompactMask | None:
    """The given mask file, or one built in the job (spec.mask_select), or None (full training);
    held compact (compute.sparsity.masks.CompactMask: the indices of the kept coordinates, not a
    bool per parameter), each tensor made dense only where it is read (issue 30)."""
    from compute.fisher import FisherConfig
    from compute.jobs.artifact_files import local_file
    from compute.sparsity.masks import CompactMask, load_compact_mask

    spec = run.spec
    mask_ref = resolved_refs(run.spec, run.refs).get("mask")
    if mask_ref is not None:
        run.summary["mask"] = {"file": spec.mask}
        _mask_fisher_reliability(run, mask_ref)
        return load_compact_mask(local_file(mask_ref, "mask"), model=run.model,
                                 device=next(run.model.parameters()).device)
    if not spec.mask_select:
        return None
    fcfg = FisherConfig(prompts=spec.fisher_prompts, samples=spec.fisher_samples,
                        max_new_tokens=spec.max_new_tokens, seed=spec.seed, device=spec.device)
    mask, info = build_mask_in_memory(
        run.model, run.tok, run.task, spec.mask_select, float(spec.mask_density or 0), spec.seed,
        fisher_config=fcfg, gradient_config=run.config, teacher=run.teacher,
        progress=lambda f, m="": run.progress(0.1 * f, m),
    )
    run.summary["mask"] = info
    if "split_half_jaccard" in (info.get("fisher") or {}):
        f = info["fisher"]
        run.summary["fisher_reliability"] = {
            "source": f"the mask's Fisher, estimated in this job ({f['prompts']} prompts x {f['samples']} samples)",
            **{k: f[k] for k in ("split_half_jaccard", "split_half_topk_percent", "reliability")}}
    return CompactMask.of(mask, next(run.model.parameters()).device)  # the dense one is freed


def _construction(run: _Run, mask: Mapping[str, torch.Tensor] | None,
                  fisher_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """compute.contract.construction.scope of this run's Fisher metrics, into the summary: inside
    the mask when it trained inside one; whether the initial Fisher is the one the mask was chosen
    from (their sha256s: the given mask file's Fisher vs the given Fisher; an independent estimate,
    or a mask built in the job from its own Fisher, is another Fisher)."""
    from compute.contract.construction import FROZEN_INCLUDED, scope
    from compute.contract.provenance import ref_label, value_label
    from compute.sparsity.masks import mask_density

    if mask is None:
        sc = scope(False)
    else:
        mask_fisher = (run.summary.get("fisher_reliability") or {}).get("source_sha256") \
            if run.spec.mask else None
        fisher_ref = resolved_refs(run.spec, run.refs).get("fisher") if run.spec.fisher else None
        fisher_sha = getattr(fisher_ref, "sha256", None) if fisher_ref is not None else None
        sc = scope(True, density=mask_density(mask), mask_fisher_sha256=mask_fisher, fisher_sha256=fisher_sha,
                   mask_label=(ref_label(run.refs["mask"]) if run.refs and "mask" in run.refs
                               else value_label(run.spec.mask, "mask")) if run.spec.mask
                   else f"built in the job ({run.spec.mask_select})")
        if not (fisher_info or {}).get("file") and not run.spec.fisher:
            sc["same_fisher"] = False  # the initial Fisher was estimated from independent samples
            sc["all_coordinates"] = FROZEN_INCLUDED
    run.summary["construction"] = sc
    return sc


def _save_trained_mask(run: _Run, mask: Mapping[str, torch.Tensor], out: Path, construction: dict[str, Any]) -> None:
    """OUT/mask.safetensors: the mask the run trained inside, with the provenance of the Fisher it
    was chosen from, so a diff or series of this model scores the Fisher inside it."""
    import json

    from compute.contract.construction import MASK_FILE
    from compute.sparsity.masks import save_mask

    meta = {"trained_inside": "1", "construction": json.dumps(construction, default=str)}
    rel = run.summary.get("fisher_reliability")
    if rel and run.spec.mask:
        meta["fisher_reliability"] = json.dumps(rel, default=str)
    save_mask(mask, out / MASK_FILE, metadata=meta)  # written a tensor at a time


def _mask_fisher_reliability(run: _Run, mask_ref: Ref) -> None:
    """The verdict of the Fisher a given mask file was built on (its metadata), if any."""
    from compute.jobs.artifact_files import stored_metadata

    if "fisher_reliability" in stored_metadata(mask_ref, "mask"):
        from compute.jobs.artifact_files import fisher_provenance

        rel = fisher_provenance(mask_ref, "mask")
        from compute.contract.provenance import ref_label

        rel["source"] = f"the Fisher of mask {ref_label(mask_ref)} ({rel.get('source')})"
        run.summary["fisher_reliability"] = rel


def _initial_fisher(
    run: _Run, probe: Any, fisher: Mapping[str, torch.Tensor] | None, info: Mapping[str, Any] | None,
    bound: bool = True,
) -> tuple[Mapping[str, torch.Tensor] | None, dict[str, Any] | None]:
    """The initial Fisher: the caller's, the spec's file, or estimated from independent samples
    when the concentration or the bound needs one."""
    from compute.jobs.artifact_files import load_scores

    spec = run.spec
    out_info: dict[str, Any] | None = None
    if fisher is not None:
        out_info = dict(info or {"source": "given by the caller"})
    elif spec.fisher:
        fisher = load_scores(resolved_refs(spec, run.refs)["fisher"], "fisher")
        out_info = {"source": "given", "file": spec.fisher}
        if "fisher_reliability" not in run.summary:  # issue 18: the given Fisher's verdict
            from compute.jobs.artifact_files import fisher_provenance

            run.summary["fisher_reliability"] = fisher_provenance(resolved_refs(spec, run.refs)["fisher"])
    elif needs_initial_fisher(spec, spec.algo == "grpo" and spec.bound and bound):  # for the concentration or the bound
        run.progress(0.1, f"initial Fisher from independent samples ({spec.independent_fisher})")
        fisher, out_info = independent_fisher(probe, run.tok, run.task, spec,
                                              lambda f, m="": run.progress(0.1 + 0.03 * f, m))
        run.result.tensors["fisher"] = dict(fisher)
    if fisher is not None:
        run.summary["initial_fisher"] = out_info
    return fisher, out_info


def _bound_plan(probe: Any, fisher: Any) -> Any:
    """How GRPO's bound check runs here (compute.contract.cost.bound_plan: in groups of coordinates
    sized to the device, or skipped), asked before the initial Fisher is made: the weights are
    resident (counted in what is free), an initial Fisher still to be made or read (4 bytes/param,
    on the host) is held beside the check when the device is the host."""
    from compute.contract.cost import bound_plan, initial_fisher_device_bytes
    from compute.lm.device import free_memory_bytes, model_device
    from compute.studies.bound import SLICE

    sizes = [p.numel() for p in probe.parameters() if p.requires_grad]
    device = model_device(probe)
    held = 0.0 if fisher is not None else initial_fisher_device_bytes(sum(sizes), device.type != "cpu")
    return bound_plan(sizes, free_memory_bytes(device), held, unit=SLICE)


def _bound(run: _Run, probe: Any, fisher: Any, fisher_info: dict[str, Any] | None, plan: Any) -> None:
    """The Cauchy-Schwarz bound on the first GRPO batch (compute.studies.bound), in the plan's
    groups of coordinates, into the result."""
    from compute.studies.bound import bound_check

    spec = run.spec
    names = [n for n, p in probe.named_parameters() if p.requires_grad]
    groups = [[(names[i], lo, hi) for i, lo, hi in g] for g in plan.groups]
    run.progress(0.13, "bound check on the first GRPO batch"
                 + (f" in {len(groups)} groups of coordinates" if len(groups) > 1 else ""))
    bsum, bseries, bheat = bound_check(
        probe, run.tok, run.task, groups=groups, fisher=fisher, fisher_info=fisher_info if fisher else None,
        aggregation=run.config.aggregation, prompts=spec.batch, group=spec.group,
        max_new_tokens=spec.max_new_tokens, seed=spec.seed, temperature=spec.temperature,
        progress=lambda f, m="": run.progress(0.13 + 0.02 * f, f"bound check: {m}"))
    mean_reward = bsum.pop("bound_mean_reward")
    run.summary["bound"] = {**bsum, "mean_reward": mean_reward}
    run.result.series += bseries
    run.result.heatmaps += bheat


def _record_run(run: _Run, res: Any) -> None:
    """Accuracies, reward window, settings and the per-step series of a finished run."""
    s = run.summary
    s.update(
        accuracy_before=res.accuracy_before, accuracy_after=res.accuracy_after,
        accuracy_gain=res.accuracy_after - res.accuracy_before, seconds=round(res.seconds, 2),
        trainable_fraction=res.trainable_fraction, settings=res.settings,
        eval={"split": "test", "prompts": run.spec.eval_prompts, "decoding": "greedy"},
    )
    if res.completion_lengths is not None:  # how long the sampled completions ran (the next estimate's)
        s["completion_lengths"] = res.completion_lengths
    rewards = [row["reward"] for row in res.curve if "reward" in row]
    if rewards:
        window = max(1, min(5, len(rewards) // 2))
        s["reward_first"] = sum(rewards[:window]) / window
        s["reward_last"] = sum(rewards[-window:]) / window
        s["reward_window"] = window
    series = run.result.series
    for row in res.curve:
        for k in ("reward", "loss", "accuracy", "reverse_kl", "kl", "grad_norm"):
            if k in row and not math.isnan(row[k]):
                series.append(SeriesPoint(f"train/{k}", row["step"], row[k]))
    series.append(SeriesPoint("eval/accuracy", 0, res.accuracy_before))
    series.append(SeriesPoint("eval/accuracy", run.spec.steps, res.accuracy_after))


def _concentration(run: _Run, res: Any, fisher: Any, base: Any,
                   mask: Mapping[str, torch.Tensor] | None = None) -> None:
    """The gradient sums over the run, and (with an initial Fisher) how well it predicted them:
    inside the mask when the run trained inside one (compute.contract.construction), where the
    gradients were free to be nonzero; the all-coordinates numbers kept labelled."""
    from compute.sparsity.overlap import concentration, restrict

    # the artifacts are dense files (0 off the mask): made here, in the report after training
    run.result.tensors["grad_sq_sum"] = dict(res.grad_sq_sum)
    run.result.tensors["grad_abs_sum"] = dict(res.grad_abs_sum)
    run.summary["gradient_updates"] = res.updates
    if fisher is None:
        return
    # the stored base is the master base exactly (fp32: the same; bf16-mixed: master weights hold
    # bf16 values; bf16: the weights themselves)
    abs_delta = {n: (p.detach().cpu().float() - base.get(n).float()).abs()
                 for n, p in run.model.named_parameters()}
    targets = {"grad_sq_sum": run.result.tensors["grad_sq_sum"], "grad_abs_sum": run.result.tensors["grad_abs_sum"],
               "abs_delta": abs_delta}
    frac = run.spec.topk_percent / 100.0
    sc = run.summary.get("construction") or {}
    if mask is not None:
        m = CompactMask.of(mask, "cpu")  # each tensor made dense when restrict reads it
        every = concentration(fisher, targets, frac)
        run.summary["concentration_all_coordinates"] = {**concentration_summary(every),
                                                        "label": sc.get("all_coordinates")}
        fisher = restrict({n: f.cpu() for n, f in fisher.items() if n in m}, m)
        targets = {k: restrict({n: t.cpu() for n, t in v.items()}, m) for k, v in targets.items()}
    conc = concentration(fisher, targets, frac)
    run.summary["concentration"] = {
        **concentration_summary(conc),
        "scope": sc.get("scope", "all coordinates"),
        "gradient": f"masked, unclipped gradient of the training loss, summed over {res.updates} updates",
        "delta": "master weights (float32 for fp32/bf16-mixed, the bf16 weights for bf16)",
    }
    run.result.heatmaps += _concentration_heatmaps(conc, sc.get("scope") if mask is not None else None)
