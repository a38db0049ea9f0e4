"""The `series` job kind: a run folder of checkpoint-N (TRL, HF Trainer, `fisherlens train
--save-steps`) read as a series: update sparsity against the base and step to step, in both delta
conventions, per layer x module; with the initial Fisher, its AUC / precision@k for the changed
coordinates and the bytes a sparse synchronisation of each step would send (compute/sparsity/series.py).

Declares the spec, the typed result and its contract, the cost, the runner and `KIND`; figures and
key numbers are in app/figures/series.py. This module is imported by the web process: the runner
imports torch and the engine inside the function.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import Field

from compute.contract.cost import CHECKPOINT_CALLS_PER_PARAM, SERIES_OPEN_CALLS, Sizing, file_memory
from compute.contract.kinds import JobKind, KindForm, TensorView
from compute.contract.results import Contract, Family, Summary, TypedResult
from compute.contract.specs import AllowOtherModel, ModelRef, Spec

# ---------------------------------------------------------------- spec


class SeriesSpec(Spec):
    """Read every checkpoint-<step> folder of RUN_DIR against BASE: sparsity over steps, step to
    step, and the bytes a sparse synchronisation of each step would send."""

    base: ModelRef
    run_dir: str = Field(
        ..., min_length=1, max_length=1000,
        description="run folder holding checkpoint-<step> subfolders (a TRL / HF Trainer output_dir "
        "saved with save_steps, or fisherlens train --save-steps), or job:<id> of such a train job")
    fisher: str | None = Field(
        None, max_length=1000, description="initial Fisher (fisher.safetensors path or 'job:<id>'): its "
        "top-k support, AUC and precision@k for the changed coordinates")
    allow_other_model: AllowOtherModel = False
    atol: float = Field(1e-5, gt=0.0, le=1.0,
                        description="tolerance of both delta conventions (|delta| <= atol is unchanged)")
    support_percent: float = Field(
        1.0, gt=0.0, le=100.0, description="Fisher top-k% forming the fixed sync support (and precision@k)")


# ---------------------------------------------------------------- result

VS_BASE, VS_PREV, SYNC, FISHER = Family("vs_base"), Family("vs_prev"), Family("sync"), Family("fisher")
# update_sparsity: unchanged in the compared precision (compute.contract.precision): exact when
# both sides are stored alike, else both cast to the lower precision; unchanged_exact: bit equality
SPARSITY_KEYS = ("update_sparsity", "unchanged_exact", "unchanged_bf16", "unchanged_atol",
                 "unchanged_bf16delta_atol")
SYNC_KEYS = ("dense_bytes", "sparse_bytes", "sync_bytes", "support_bytes", "captured_count_share",
             "captured_sq_share")
N_SYNC_PLAIN = 3  # SYNC_KEYS without a Fisher
FISHER_KEYS = ("auc", "precision_at_k")
HEATMAP_PAIRS = {"step_sparsity_layer_module": "vs_prev", "base_sparsity_layer_module": "vs_base"}
CAPTURE_HEATMAP = "step_captured_sq_layer_module"


class SeriesSummary(Summary):
    base: str | None = None
    run_dir: str | None = None
    fisher: str | None = None
    steps: list[int] | None = None
    n_params: int | None = None
    dtype: str | None = None
    atol: float | None = None
    final_update_sparsity: float | None = None  # in comparison_dtype (the headline)
    final_unchanged_exact: float | None = None
    # compute.contract.precision: the stored dtypes of both sides and the convention of the headline
    stored_dtypes: dict[str, str] | None = None
    comparison_dtype: str | None = None
    comparison: str | None = None
    comparison_rule: str | None = None
    sync_bytes_total: float | None = None  # per tensor and step the cheaper of sparse and dense
    final_unchanged_bf16delta_atol: float | None = None
    mean_step_sparsity: float | None = None
    mean_step_unchanged_bf16delta_atol: float | None = None
    dense_bytes_total: float | None = None
    sparse_bytes_total: float | None = None
    support_bytes_total: float | None = None
    mean_captured_count_share: float | None = None
    mean_captured_sq_share: float | None = None
    mean_step_auc: float | None = None
    support_percent: float | None = None
    points: list[dict[str, Any]] | None = None  # per checkpoint: step and the global numbers


class SeriesResult(TypedResult[SeriesSummary]):
    kind: Literal["series"]


CONTRACT = Contract("series", SeriesResult, heatmaps=(*HEATMAP_PAIRS, CAPTURE_HEATMAP),
                    series_families=(VS_BASE, VS_PREV, SYNC, FISHER))


# ---------------------------------------------------------------- the kind


def cost(s: SeriesSpec) -> int:
    return 0  # reads checkpoints, no forward passes (app/limits.py charges a pass over the weights)


def timing(s: SeriesSpec, z: Sizing) -> dict[str, float]:
    """Reading the base and each checkpoint tensor by tensor (their count is not known before
    the folder is listed: priced as the base and one checkpoint, per parameter)."""
    return {"open": z.calls_s(SERIES_OPEN_CALLS), "compare": z.calls_s(2 * CHECKPOINT_CALLS_PER_PARAM * z.params)}


def memory(s: SeriesSpec, z: Sizing) -> dict[str, float]:
    return file_memory(z, models=0) | {"tensors": 2 * 4.0 * z.params}


KIND = JobKind(
    name="series", title="Run folder series", spec=SeriesSpec, contract=CONTRACT,
    runner="compute.jobs.series:run", cost=cost, order=65, timing=timing, memory=memory,
    refs={"base": "model", "run_dir": "run_dir", "fisher": "fisher"},
    form=KindForm(tab="Run series", button="Read run folder", cost=False,
                  main=("base", "run_dir", "fisher", "support_percent", "atol")),
    cli_args=("base", "run_dir"),
    example={"base": "arith-base", "run_dir": "job:2"},
    tensors=TensorView(value="|delta| (last checkpoint)", pair=("base", "run_dir"), last_checkpoint=True,
                       config_field="base", fisher_field="fisher", k_fields=("support_percent",)),
)


# ---------------------------------------------------------------- the runner (worker and CLI only)


def run(spec: SeriesSpec, progress: Any = None, refs: Any = None) -> Any:
    """The series of spec.run_dir against spec.base: JobResult with the global numbers per point in
    the summary, the curves as series rows, layer x module over steps as heatmaps, and the whole
    series (every grouping) as the file artifact "series" (series.json). `refs`: the resolved
    references (the worker and the CLI pass them; read where they are, no database)."""
    t0 = time.perf_counter()  # the run's imports are the job's "open" part
    import tempfile
    from pathlib import Path

    from compute.contract.jobresult import JobResult, null_progress
    from compute.jobs.artifact_files import local_file, resolved_refs
    from compute.sparsity.series import LazyTensors, SeriesConfig, checkpoint_series, write_series

    progress = progress or null_progress
    progress(0.0, "opening the run folder")
    refs = resolved_refs(spec, refs)
    base_ref, run_ref = refs.get("base"), refs.get("run_dir")
    assert base_ref is not None and run_ref is not None  # both required by the spec
    base, run_dir = base_ref.where(), run_ref.where()
    fisher = None
    summary_extra: dict[str, Any] = {}
    fisher_ref = refs.get("fisher")
    if fisher_ref is not None:
        from compute.jobs.artifact_files import fisher_provenance

        fisher = LazyTensors(local_file(fisher_ref, "fisher"), "fisher")
        summary_extra = {"fisher_reliability": fisher_provenance(fisher_ref)}  # the Fisher's verdict
    within = None
    if fisher is not None:  # a run trained inside a mask: its Fisher shares inside the mask
        from compute.jobs.diff_run import trained_mask

        within, construction = trained_mask(Path(run_dir), fisher_ref)
        if construction is not None:
            summary_extra["construction"] = construction
    config = SeriesConfig(atol=spec.atol, support_percent=spec.support_percent)
    t_open = time.perf_counter()
    res = checkpoint_series(base, run_dir, fisher=fisher, config=config,
                            progress=lambda f, m="": progress(0.95 * f, m), within=within)
    out = Path(tempfile.mkdtemp(prefix="fisherlens-series-"))
    path = write_series(res, out)
    summary = _summary(spec, res)
    summary.update(summary_extra)
    # where the time went, by series.timing's parts
    summary["seconds_parts"] = {"open": round(t_open - t0, 3), "compare": round(time.perf_counter() - t_open, 3)}
    result = JobResult(kind="series", summary=summary, series=_curves(res, spec.atol),
                       heatmaps=_heatmaps(res, spec.atol), files={"series": str(path)})
    progress(1.0, f"{len(res.points)} checkpoints")
    return result


def _g(point: dict[str, Any], pair: str, key: str, atol: float) -> Any:
    m = point[pair]["global"]["all"]
    if key in ("unchanged_atol", "unchanged_bf16delta_atol"):
        key = f"{key}_{atol:g}"
    return m.get(key)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def _mean(xs: list[Any]) -> float | None:
    vals = [v for v in (_finite(x) for x in xs) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _summary(spec: SeriesSpec, res: Any) -> dict[str, Any]:
    pts = res.points
    last = pts[-1]
    with_fisher = "fisher" in res.settings
    compact = []
    for p in pts:
        row: dict[str, Any] = {"step": p["step"], "checkpoint": p["checkpoint"], "seconds": p["seconds"]}
        for pair in ("vs_base", "vs_prev"):
            for k in SPARSITY_KEYS:
                row[f"{pair}_{k}"] = _finite(_g(p, pair, k, spec.atol))
        for k in SYNC_KEYS if with_fisher else SYNC_KEYS[:N_SYNC_PLAIN]:
            row[k] = _finite(_g(p, "vs_prev", k, spec.atol))
        if with_fisher:
            for k in FISHER_KEYS:
                row[f"vs_prev_{k}"] = _finite(_g(p, "vs_prev", k, spec.atol))
                row[f"vs_base_{k}"] = _finite(_g(p, "vs_base", k, spec.atol))
        if p.get("trainer", {}).get("log"):
            row["trainer"] = {k: _finite(v) for k, v in p["trainer"]["log"].items()}
        compact.append(row)
    from compute.contract.precision import merge

    prec = merge([p.get("vs_base_precision") for p in pts]) or {}
    out: dict[str, Any] = {
        "stored_dtypes": prec.get("stored_dtypes"), "comparison_dtype": prec.get("comparison_dtype"),
        "comparison": prec.get("comparison"), "comparison_rule": prec.get("rule"),
        "final_unchanged_exact": _finite(_g(last, "vs_base", "unchanged_exact", spec.atol)),
        "sync_bytes_total": sum(_g(p, "vs_prev", "sync_bytes", spec.atol) for p in pts),
        "base": spec.base, "run_dir": spec.run_dir, "fisher": spec.fisher,
        "steps": [p["step"] for p in pts], "n_params": int(last["vs_base"]["global"]["all"]["numel"]),
        "dtype": last.get("dtype"), "atol": spec.atol,
        "final_update_sparsity": _finite(_g(last, "vs_base", "update_sparsity", spec.atol)),
        "final_unchanged_bf16delta_atol": _finite(_g(last, "vs_base", "unchanged_bf16delta_atol", spec.atol)),
        "mean_step_sparsity": _mean([_g(p, "vs_prev", "update_sparsity", spec.atol) for p in pts]),
        "mean_step_unchanged_bf16delta_atol": _mean([_g(p, "vs_prev", "unchanged_bf16delta_atol", spec.atol)
                                                     for p in pts]),
        "dense_bytes_total": sum(_g(p, "vs_prev", "dense_bytes", spec.atol) for p in pts),
        "sparse_bytes_total": sum(_g(p, "vs_prev", "sparse_bytes", spec.atol) for p in pts),
        "points": compact,
        "settings": res.settings,
        "skipped": res.skipped,
    }
    if with_fisher:
        out.update(
            support_percent=spec.support_percent,
            support_bytes_total=sum(_g(p, "vs_prev", "support_bytes", spec.atol) for p in pts),
            mean_captured_count_share=_mean([_g(p, "vs_prev", "captured_count_share", spec.atol) for p in pts]),
            mean_captured_sq_share=_mean([_g(p, "vs_prev", "captured_sq_share", spec.atol) for p in pts]),
            mean_step_auc=_mean([_g(p, "vs_prev", "auc", spec.atol) for p in pts]))
    return out


def _curves(res: Any, atol: float) -> list[Any]:
    """Series rows: vs_base/<metric>, vs_prev/<metric>, sync/<bytes and shares>, fisher/<metric>_<pair>."""
    from compute.contract.jobresult import SeriesPoint

    out = []
    with_fisher = "fisher" in res.settings
    for p in res.points:
        step = p["step"]
        for pair in ("vs_base", "vs_prev"):
            for k in SPARSITY_KEYS:
                v = _finite(_g(p, pair, k, atol))
                if v is not None:
                    out.append(SeriesPoint(f"{pair}/{k}", step, v))
        for k in SYNC_KEYS if with_fisher else SYNC_KEYS[:N_SYNC_PLAIN]:
            v = _finite(_g(p, "vs_prev", k, atol))
            if v is not None:
                out.append(SeriesPoint(f"sync/{k}", step, v))
        if with_fisher:
            for pair in ("vs_base", "vs_prev"):
                for k in FISHER_KEYS:
                    v = _finite(_g(p, pair, k, atol))
                    if v is not None:
                        out.append(SeriesPoint(f"fisher/{k}_{pair}", step, v))
    return out


def _heatmaps(res: Any, atol: float) -> list[Any]:
    """layer x module (rows) over steps (columns): update sparsity step to step and against the
    base, and (with a Fisher) the share of each step's squared update on the support."""
    from compute.contract.jobresult import Heatmap
    from compute.lm.naming import layer_sort_key

    pts = res.points
    groups = sorted(pts[0]["vs_prev"]["layer_module"],
                    key=lambda g: (layer_sort_key(g.split("/")[0]), g.split("/")[1]))
    steps = [str(p["step"]) for p in pts]

    from compute.contract.precision import merge, unchanged_units

    def hm(name: str, pair: str, key: str, units: str, title: str | None = None) -> Any:
        z = [[_finite(p[pair]["layer_module"][g].get(key)) for p in pts] for g in groups]
        meta = {"x_title": "step", "y_title": "layer/module", "units": units, "zmin": 0.0, "zmax": 1.0}
        if title:
            meta["title"] = title
        return Heatmap(name=name, x_labels=steps, y_labels=groups, z=z, meta=meta)

    out = []
    for name, pair in HEATMAP_PAIRS.items():  # the headline convention, named in the title
        units = unchanged_units(merge([p.get(f"{pair}_precision") for p in pts]))
        vs = "vs base" if pair == "vs_base" else "step to step"
        out.append(hm(name, pair, "update_sparsity", units,
                      f"{units[0].upper()}{units[1:]} by layer x module over steps ({vs})"))
    if "fisher" in res.settings:
        out.append(hm(CAPTURE_HEATMAP, "vs_prev", "captured_sq_share",
                      "share of the step's squared update on the Fisher support"))
    return out
