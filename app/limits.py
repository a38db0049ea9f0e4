"""Per-job cost estimates, spec size caps and per-user quotas (no torch: the web process uses it).

Cost unit: **parameter-token-passes** = token-passes x parameters, where a token-pass is one
token through one forward pass and a backward pass counts as two forward passes (so a gradient
step over a sequence of L tokens is 3 L token-passes). Two forward+backward FLOPs per parameter
per token-pass makes `2 * cost` a rough FLOP count. Each job kind says its token-passes (its
`cost`, compute/jobs/<kind>.py, with the shared formulas and assumptions of
compute/contract/cost.py: prompts counted as `COST_PROMPT_TOKENS` tokens, every completion as
`max_new_tokens`), so the estimate is an upper bound for the given prompt length.

Ceiling: by default a user's job may not run longer than MAX_JOB_SECONDS (2 h), compared with
the estimated seconds: the kind's timing on the machine's calibration (app/ceiling.calibration:
`fisherlens calibrate`'s file, else the committed reference machine's, and the estimate says
which). The cost ceiling it also stands for is `seconds x throughput`, the one constant
`benchmarks/bench_throughput.py` measured on real jobs (THROUGHPUT / THROUGHPUT_FILE override it). An explicit cost
ceiling (MAX_JOB_COST, a user's own `max_job_cost`) or a user's own `max_job_seconds` replaces
it; admins and the local user have none unless MAX_JOB_SECONDS_ADMIN / MAX_JOB_COST_ADMIN is set.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.ceiling import (
    REPO_THROUGHPUT,
    calibration,
    duration,
    job_ceiling,
    seconds_of,
    throughput,
    worker_devices,
)
from app.services.compat import safetensors_header
from compute.contract.cost import COST_PROMPT_TOKENS, MIB, Sizing, config_shape
from compute.contract.specs import SpecError
from compute.contract.tasknames import prompt_tokens
from compute.jobs import registry

__all__ = ["REPO_THROUGHPUT", "job_ceiling", "throughput"]  # the ceiling's half: app/ceiling.py


class QuotaExceeded(SpecError):
    """Over a per-user limit (HTTP 429): `errors[0]` has field, message, limit and value."""


class ConfirmationRequired(SpecError):
    """The estimate is above CONFIRM_ABOVE_S and the request did not confirm (HTTP 422, field
    `confirm`; `errors[0]` has the estimated `seconds` and the threshold `limit`): resend with
    "confirm": true (API), --yes (CLI), the checkbox (form)."""


def _errors(*items: dict[str, Any]) -> Any:
    """SpecError's errors, with the numbers (limit, value) next to the message."""
    return list(items)


# ---------------------------------------------------------------- parameter counts


def safetensors_numel(path: Path) -> int:
    """Number of elements stored in one .safetensors file, read from its JSON header only;
    ValueError when it is not one."""
    header = safetensors_header(path)
    if not isinstance(header, dict):
        raise ValueError("is not a safetensors file (its header is not a JSON object)")
    return sum(
        math.prod(int(d) for d in entry.get("shape", []))
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict)
    )


def count_params(folder: Path, trust_info: bool = True) -> int | None:
    """Parameters of a local HF model folder: fisherlens.json's count for zoo models (and
    trained models in the artifact store: `trust_info`; a user's own folder could write any
    number there, so its headers are counted), else the sum over its safetensors headers; None
    when the folder has no safetensors weights."""
    info = folder / "fisherlens.json"
    if trust_info and info.is_file():
        try:
            extra = json.loads(info.read_text())
            n = extra.get("n_params") or extra.get("params")
            if isinstance(n, int) and n > 0:
                return n
        except (OSError, json.JSONDecodeError):
            pass
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    try:
        return sum(safetensors_numel(f) for f in files)
    except ValueError:
        return None


def model_params(ref: Any) -> int | None:
    """Parameter count of a resolved model reference (app.services.refs: zoo, local folder,
    job:N), or None when it cannot be counted here (hub ids, folders without safetensors)."""
    path = Path(ref.local) if ref.local else None
    trusted = getattr(ref, "form", "zoo") in ("zoo", "artifact")
    return count_params(path, trust_info=trusted) if path is not None and path.is_dir() else None


def reference_files(settings: Any, kind: str, spec: Any,
                    refs: dict[str, Any] | None) -> dict[str, tuple[str, Path | None]]:
    """field -> (target, local file or None when not readable here) for the Fisher / mask /
    gradient files a spec reads, resolved once (the one resolver; `refs` None or lacking them:
    resolved here for the caller, as estimate does for models)."""
    from app.services import refs as resolver

    values = {f: v for f, v in resolver.spec_values(kind, spec).items() if v[1] != "model" and v[1] != "run_dir"}
    if values and (refs is None or not all(f in refs for f in values)):
        from app import auth

        refs, _ = resolver.resolve_values(settings, values, auth.optional_user(settings))
    out: dict[str, tuple[str, Path | None]] = {}
    for field, (_, target) in values.items():
        ref = (refs or {}).get(field)
        local = getattr(ref, "local", None)
        out[field] = (target, Path(local) if local and Path(local).is_file() else None)
    return out


def data_elements(files: dict[str, tuple[str, Path | None]]) -> int:
    """Elements of the reference files (reference_files: their safetensors headers, bounded and
    validated by app.services.compat); a file not readable here counts 0."""
    total = 0
    for _, path in files.values():
        if path is None:
            continue
        try:
            total += safetensors_numel(path)
        except ValueError:
            continue
    return total


def mask_density(files: dict[str, tuple[str, Path | None]]) -> float | None:
    """The density of the mask file a spec trains with, as its writer recorded it in the file's
    header (compute.sparsity.masks.save_mask: `__metadata__.density`, read without the tensors);
    None when the spec names no mask or the file does not say."""
    masks = [path for target, path in files.values() if target == "mask"]
    if not masks:
        return None
    out = 0.0
    for path in masks:
        if path is None:
            return None
        try:
            meta = (safetensors_header(path) or {}).get("__metadata__") or {}
            d = float(str(meta.get("density")))
        except (ValueError, TypeError, AttributeError):
            return None
        if not 0.0 <= d <= 1.0:
            return None
        out = max(out, d)
    return out


# ---------------------------------------------------------------- token-passes per kind


def token_passes(kind: str, spec: Any) -> int:
    """Token-passes of a validated spec: its kind's `cost` (compute/jobs/<kind>.py; every kind
    has one, the registry refuses a kind without). ValueError naming the accepted kinds for an
    unknown kind."""
    return int(registry.get(kind).cost(spec))


def model_shape(ref: Any) -> dict[str, Any]:
    """{"layers", "hidden", "vocab", "intermediate"} of a resolved model reference from its config.json (text
    config of a multimodal one); {} when unreadable here."""
    path = Path(ref.local) / "config.json" if getattr(ref, "local", None) else None
    if path is None or not path.is_file() or path.stat().st_size > 1_000_000:
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, Any] = config_shape(cfg) if isinstance(cfg, dict) else {}
    # the Fisher job skips its exact output-layer check for a tied embedding (fisher_run: the
    # shared matrix's Monte-Carlo Fisher includes its input use); the estimate too, where the
    # config says so (a key left out is read as untied: the check counted, as before)
    text = cfg.get("text_config") if isinstance(cfg, dict) else None
    if any(isinstance(c, dict) and c.get("tie_word_embeddings") is True for c in (cfg, text)):
        out["tied"] = True
    # a tied input/output embedding needs no per-row gradient buffer in the Fisher engine since
    # issue 30 (compute/fisher/accumulate.py: the head's squares plus the touched rows whole), so
    # Sizing.shared stays 0 for it (compute/fisher/estimators.py _shared_numel)
    return out


def free_memory(settings: Any, device: str = "auto") -> tuple[float | None, str]:
    """(bytes a job may use on the device a job of this spec runs on, where the figure comes
    from): MAX_JOB_MEMORY_MB when set; the live workers' devices as they wrote them
    (app.ceiling.worker_devices: the smallest, since a queued job may run on any; a cpu spec on a
    GPU worker: its host's RAM), except for a job run here (app.ceiling.here); CUDA: torch.cuda.mem_get_info of the device (only where
    torch is already imported: the web process does not import it for this); CPU: MemAvailable
    of /proc/meminfo. (None, why) when unknown."""
    if settings.max_job_memory_mb:
        return float(settings.max_job_memory_mb) * MIB, "MAX_JOB_MEMORY_MB"
    figures = []  # (free, where) of each live worker's device for this spec (storage/workers.py)
    for w in worker_devices(settings):
        on_host = device == "cpu" and not str(w["device"]).startswith("cpu")
        free = w["host_free_bytes"] if on_host else w["free_bytes"]
        if free is not None:
            figures.append((float(free), f"{'cpu' if on_host else w['device']} of worker {w['name']}"))
    if figures:  # a queued job may run on any of them: the smallest is what it can count on
        free, where = min(figures)
        # the figure's device first: Sizing.device_is_gpu reads it ("cuda...")
        return free, (where if len(figures) == 1 else f"{where} (the smallest of {len(figures)} workers' devices)")
    import sys

    torch = sys.modules.get("torch")
    if device != "cpu" and torch is not None:
        try:
            if torch.cuda.is_available():
                index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
                free, _ = torch.cuda.mem_get_info(index)
                return float(free), f"cuda:{index}"
        except Exception:  # noqa: BLE001 - no usable GPU here: the CPU figure
            pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024, "cpu"
    except OSError:
        pass
    return None, "unknown"


def sizing(settings: Any, kind: str, spec: Any, refs: dict[str, Any], params: int,
           data: int, density: float | None = None,
           history: Mapping[float, list[tuple[int, dict[str, Any]]]] | None = None) -> Sizing:
    """The Sizing a kind's timing and memory read: the largest model's shape, the files read,
    the calibration (seconds = token_passes x (a + b x params)) and the free memory."""
    from app.services import refs as resolver

    shape: dict[str, Any] = {}
    models = 0
    for field, (_, target) in resolver.spec_values(kind, spec).items():
        if target != "model" or field not in refs:
            continue
        models += 1
        n = model_params(refs[field])
        if n is not None and n >= params:
            shape = model_shape(refs[field]) or shape
    cal = calibration(settings)
    if cal is not None:
        a, b = cal[0], cal[1]
    else:
        tp = throughput(settings)
        a, b = 0.0, (1.0 / tp[0] if tp else 0.0)
    free, where = free_memory(settings, str(getattr(spec, "device", "auto")))
    task = getattr(spec, "task", None)
    prompt = prompt_tokens(task, COST_PROMPT_TOKENS) if isinstance(task, str) else COST_PROMPT_TOKENS
    stops = {t: [r for _, r in recs] for t, recs in (history or {}).items()}
    return Sizing(params=params, data_elements=data, a=a, b=b, free_bytes=free,
                  models=max(models, 1) if params else 0, prompt_tokens=prompt,
                  mask_density=density, device_is_gpu=where.startswith("cuda"), stops=stops or None, **shape)


def estimate(settings: Any, kind: str, spec: Any, refs: dict[str, Any]) -> dict[str, Any]:
    """{"token_passes", "params", "cost", "seconds", "seconds_parts", "memory_bytes",
    "memory_parts", "memory_host_parts", "needs_confirmation", ...}. `params` is the largest model
    the spec names (None if it cannot be counted); `cost` = token_passes x params (at least one pass
    over the weights), None when params is None. `seconds`: the kind's timing (compute/jobs/<kind>.py)
    on the calibrated machine, else token-passes x (a + b x params); `memory_bytes`: the kind's
    predicted peak on the job's device (the sum of `memory_parts`); `memory_host_parts`: what the
    kind keeps in host memory beside it on a GPU (its `host_memory`: train's initial Fisher), not
    in that sum and checked against nothing, {} when none. `refs`: the spec's resolved references,
    from the one resolver (submit's, or app.services.refs.model_refs for an estimate alone); a
    model field missing from them (another user's job:N is never resolved) counts exactly like
    one that does not exist: unknown."""
    from app.services import refs as resolver

    values = {f: v for f, v in resolver.spec_values(kind, spec).items() if v[1] == "model"}
    params: int | None = None
    unknown: list[str] = []
    for field in values:
        n = model_params(refs[field]) if field in refs else None
        if n is None:
            unknown.append(field)
        else:
            params = max(params or 0, n)
    passes = token_passes(kind, spec)
    if not values:
        params = 0  # no model named (a mask from a stored Fisher): no model runs
    files = reference_files(settings, kind, spec, refs)
    data = data_elements(files)
    # at least one pass over the weights, and over every Fisher / mask / gradient file it reads
    # (a mask's selection is a pass over its Fisher: its cost is that file's size, not 0)
    cost = None if unknown or params is None else float(max(passes, 1) * max(params, data))
    tp = throughput(settings)
    timed = seconds_of(settings, passes, params) if cost is not None and params is not None else None
    parts: dict[str, float] | None = None
    model_parts: dict[str, float] | None = None  # the cost model's parts, before the clock's corrections
    lengths_from: dict[str, Any] | None = None  # the recorded completion lengths its sampling is priced on
    corrections: dict[str, dict[str, Any]] = {}
    mem_parts: dict[str, float] | None = None
    host_parts: dict[str, float] = {}
    k = registry.get(kind)
    z: Sizing | None = None
    if cost is not None and params is not None:
        history = stop_history(settings, spec) if k.timing is not None else {}
        z = sizing(settings, kind, spec, refs, params, data, mask_density(files), history)
        if k.timing is not None and timed is not None and calibration(settings) is not None:
            parts = {p: float(v) for p, v in k.timing(spec, z).items()}
            model_parts = dict(parts)
            lengths_from = lengths_basis(history, spec)
            corrections = clock_corrections(settings, kind, spec, parts, lengths_from is not None)
            for p, c in corrections.items():
                parts[p] *= c["factor"]
            timed = (sum(parts.values()), timed[1] + lengths_text(lengths_from) + correction_text(corrections))
        if k.memory is not None:
            mem_parts = {p: float(v) for p, v in k.memory(spec, z).items()}
        if k.host_memory is not None:
            host_parts = {p: float(v) for p, v in k.host_memory(spec, z).items()}
    seconds = timed[0] if timed else None
    options = memory_options(k, spec, z, sum(mem_parts.values()) if mem_parts else None, parts is not None)
    confirm_above = settings.confirm_above_s or None
    return {
        "kind": kind,
        "token_passes": passes,
        "params": params,
        "cost": cost,
        "unknown_models": unknown,
        "prompt_tokens_assumed": (z.prompt_tokens if z is not None else COST_PROMPT_TOKENS),
        "throughput": tp[0] if tp else None,
        "seconds": seconds,
        "seconds_from": timed[1] if timed else None,
        "seconds_parts": parts,
        "model_seconds_parts": model_parts,
        "seconds_corrections": corrections,
        "completion_lengths_from": lengths_from,
        "memory_bytes": sum(mem_parts.values()) if mem_parts else None,
        "memory_parts": mem_parts,
        "memory_host_parts": host_parts,
        "memory_options": options,
        # whether the peak fits the memory the job's device has free (None: not predicted / unknown)
        "memory_fits": (None if not mem_parts or z is None or z.free_bytes is None
                        else sum(mem_parts.values()) <= z.free_bytes),
        "confirm_above_s": confirm_above,
        "needs_confirmation": bool(confirm_above and seconds is not None and seconds > confirm_above),
    }


# The estimate learns from the clock: each part of a job's estimate is scaled by how long that part
# took against its cost-model estimate in the latest jobs of the same kind on the same model (the
# median of at most CORRECTION_JOBS, kept within CORRECTION_RANGE). What the cost model cannot know
# before a run, it learns from the runs: how early a model's completions stop (sampling is counted
# to max_new_tokens), how loaded the machine is.
CORRECTION_JOBS = 5
CORRECTION_RANGE = (0.25, 4.0)
# How many of the latest jobs' recorded completion lengths an estimate reads (stop_history)
LENGTH_JOBS = 10


def _model_field(kind: str, spec: Any) -> tuple[str, str] | None:
    """(field, value as written) of the first model a spec names (its `model`, a diff's `base`)."""
    from compute.jobs import registry

    return next(((f, str(v)) for f, (v, target) in registry.ref_values(kind, spec).items() if target == "model"), None)


def clock_corrections(settings: Any, kind: str, spec: Any, parts: Mapping[str, float],
                      on_lengths: bool = False) -> dict[str, dict[str, Any]]:
    """{part: {"factor", "jobs"}} from the latest succeeded jobs of `kind` on the same model that
    kept their estimate: each part's measured seconds over its cost-model seconds (their
    `model_seconds_parts`, so corrections never compound), the median of at most CORRECTION_JOBS
    jobs, within CORRECTION_RANGE. Only jobs whose sampling was priced on the same basis
    (`on_lengths`: on recorded completion lengths, stop_history, or to max_new_tokens) count: a
    correction learned against the upper bound would shrink an estimate already priced on the
    lengths a second time. {} when there are none or no database to ask (an embedded store that
    does not exist yet is not created for an estimate)."""
    named = _model_field(kind, spec)
    url = _history_url(settings)
    if named is None or url is None:
        return {}
    try:
        from storage import repo
        from storage.db import migrated_session_factory

        with migrated_session_factory(url)() as s:
            rows = repo.recent_timings(session=s, kind=kind)
    except Exception:  # noqa: BLE001 - an estimate never fails for want of history
        return {}
    ratios: dict[str, list[float]] = {p: [] for p in parts}
    for spec_j, est_j, took_j in rows:
        if str(spec_j.get(named[0])) != named[1]:  # the stored spec, as submitted
            continue
        if bool(est_j.get("completion_lengths_from")) != on_lengths:
            continue
        base = est_j.get("model_seconds_parts") or est_j.get("seconds_parts") or {}
        for p, r in ratios.items():
            b, t = base.get(p), took_j.get(p)
            if len(r) < CORRECTION_JOBS and isinstance(b, int | float) and isinstance(t, int | float) and b > 0:
                r.append(float(t) / float(b))
    lo, hi = CORRECTION_RANGE
    return {p: {"factor": min(hi, max(lo, statistics.median(r))), "jobs": len(r)} for p, r in ratios.items() if r}


def correction_text(corrections: Mapping[str, Mapping[str, Any]]) -> str:
    """"; by the clock of N earlier jobs on this model: sampling x0.31, ..." (the parts it moved by
    5% or more), or "" without corrections."""
    if not corrections:
        return ""
    n = max(int(c["jobs"]) for c in corrections.values())
    shown = ", ".join(f"{p} x{c['factor']:.2g}" for p, c in corrections.items() if abs(c["factor"] - 1) >= 0.05)
    return f"; by the clock of {n} earlier job{'s' if n > 1 else ''} on this model" + (f": {shown}" if shown else "")


def _history_url(settings: Any) -> str | None:
    """The database an estimate may read history from, None where there is none yet (an embedded
    store that does not exist is not created for an estimate)."""
    url = str(getattr(settings, "db_url", "") or "")
    if not url or (url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists()):
        return None
    return url


def stop_history(settings: Any, spec: Any) -> dict[float, list[tuple[int, dict[str, Any]]]]:
    """{temperature: [(job id, completion_lengths record)]} of the latest jobs that sampled the
    model `spec` samples from (its `model` field, as written) on its task (storage
    recent_completion_lengths, at most LENGTH_JOBS), newest first: what compute.contract.cost's
    Sizing.generate_s prices a sampled batch's length by. {} for a spec that samples nothing (no
    model, task and temperature of its own: a mask, a diff, a tokens job), or with no history."""
    model, task = getattr(spec, "model", None), getattr(spec, "task", None)
    url = _history_url(settings)
    if not isinstance(model, str) or not isinstance(task, str) or not hasattr(spec, "temperature") or url is None:
        return {}
    try:
        from storage import repo
        from storage.db import migrated_session_factory

        with migrated_session_factory(url)() as s:
            rows = repo.recent_completion_lengths(session=s, model=model, task=task, limit=LENGTH_JOBS)
    except Exception:  # noqa: BLE001 - an estimate never fails for want of history
        return {}
    out: dict[float, list[tuple[int, dict[str, Any]]]] = {}
    for job_id, temperature, rec in rows:
        out.setdefault(float(temperature), []).append((job_id, rec))
    return out


def lengths_basis(history: Mapping[float, list[tuple[int, dict[str, Any]]]], spec: Any) -> dict[str, Any] | None:
    """{"jobs": [ids], "rows": n, "temperature"} of the recorded lengths (stop_history) the
    estimate's sampling at the spec's temperature is priced on, None when none are (priced to
    max_new_tokens)."""
    recs = history.get(float(getattr(spec, "temperature", 1.0) or 1.0))
    if not recs:
        return None
    return {"jobs": [i for i, _ in recs], "rows": sum(int(r.get("rows") or 0) for _, r in recs),
            "temperature": float(getattr(spec, "temperature", 1.0) or 1.0)}


def lengths_text(basis: Mapping[str, Any] | None) -> str:
    """"; sampling priced on how long 64 completions of this model ran (jobs 3, 5)", or ""."""
    if not basis:
        return ""
    jobs = basis["jobs"]
    named = ", ".join(str(j) for j in jobs[:3]) + (", ..." if len(jobs) > 3 else "")
    return (f"; sampling priced on how long {basis['rows']:,} completions of this model on this task ran "
            f"(job{'s' if len(jobs) > 1 else ''} {named})")


def submitted_estimate(est: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a job keeps of its estimate at submit (jobs.estimate): the seconds, where they come
    from, by part, and the predicted peak memory; None when nothing was estimated."""
    keep = {k: est.get(k) for k in ("seconds", "seconds_from", "seconds_parts", "model_seconds_parts",
                                     "completion_lengths_from", "memory_bytes")}
    return keep if keep["seconds"] is not None or keep["memory_bytes"] is not None else None


def memory_options(k: Any, spec: Any, z: Sizing | None, need: float | None, timed: bool) -> list[dict[str, Any]]:
    """The kind's `memory_options` that lower the predicted peak, each priced by the kind's own
    memory and timing on the same Sizing: [{"change": {field: value}, "memory_bytes": ...,
    "seconds": ... or None}], in the kind's order. A change the spec already has is skipped."""
    if z is None or need is None or k.memory is None:
        return []
    out: list[dict[str, Any]] = []
    for change in k.memory_options:
        if all(getattr(spec, f, None) == v for f, v in change.items()):
            continue
        alt = spec.model_copy(update=dict(change))
        m = float(sum(k.memory(alt, z).values()))
        if m >= need:
            continue
        secs = float(sum(k.timing(alt, z).values())) if timed and k.timing is not None else None
        out.append({"change": dict(change), "memory_bytes": m, "seconds": secs})
    return out


def option_text(option: dict[str, Any]) -> str:
    """"gradient_checkpointing=true: about 7.2 GB, about 3 min" (spec field names, JSON values)."""
    change = ", ".join(f"{f}={json.dumps(v)}" for f, v in option["change"].items())
    took = f", about {duration(option['seconds'])}" if option.get("seconds") is not None else ""
    return f"{change}: about {size_text(option['memory_bytes'])}{took}"


def refs_for_estimate(settings: Any, kind: str, spec: Any) -> dict[str, Any]:
    """The model references of `spec` as the caller may use them (the one resolver, no hashing):
    what an estimate outside submit (the API's /api/estimate, the form's hint) passes in."""
    from app import auth
    from app.services import refs as resolver

    values = {f: v for f, v in resolver.spec_values(kind, spec).items() if v[1] == "model"}
    refs, _ = resolver.resolve_values(settings, values, auth.optional_user(settings), hash_models=False)
    return refs


def size_text(n: float) -> str:
    """Bytes for a person: 71 GB, 850 MB (decimal units, as device makers state them)."""
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def memory_text(est: dict[str, Any]) -> str:
    """"needs about 1.2 GB of memory" (empty when not predicted)."""
    if not est.get("memory_bytes"):
        return ""
    return f"needs about {size_text(est['memory_bytes'])} of memory"


def host_text(est: dict[str, Any]) -> str:
    """"; in host memory, not on the device: initial Fisher 32.8 GB" (empty when the kind keeps
    nothing apart: on a CPU its peak counts everything)."""
    parts = est.get("memory_host_parts") or {}
    if not parts:
        return ""
    return "; in host memory, not on the device: " + ", ".join(f"{p} {size_text(v)}" for p, v in parts.items())


def check_confirm(est: dict[str, Any], confirm: bool) -> None:
    """ConfirmationRequired when the estimate is above the confirmation threshold and the
    caller did not confirm."""
    if confirm or not est.get("needs_confirmation"):
        return
    took = duration(float(est["seconds"]))
    raise ConfirmationRequired(_errors({
        "field": "confirm",
        "message": f"this job takes about {took} (estimated, {est.get('seconds_from')}), above the "
                   f"confirmation threshold of {duration(float(est['confirm_above_s']))} "
                   "(CONFIRM_ABOVE_S): resend it with \"confirm\": true (CLI: --yes) to queue it",
        "limit": est["confirm_above_s"], "value": est["seconds"], "seconds": est["seconds"],
    }))


def check_memory(settings: Any, est: dict[str, Any], spec: Any) -> None:
    """SpecError (422, field `memory`) when the predicted peak does not fit the memory the job's
    device has free (or MAX_JOB_MEMORY_MB), with both figures: "needs 71 GB; cuda:0 has 62 GB
    free"."""
    need = est.get("memory_bytes")
    if not need:
        return
    free, where = free_memory(settings, str(getattr(spec, "device", "auto")))
    if free is None or need <= free:
        return
    has = (f"MAX_JOB_MEMORY_MB allows {size_text(free)}" if where == "MAX_JOB_MEMORY_MB"
           else f"{where} has {size_text(free)} free")
    options = est.get("memory_options") or []
    fits = [o for o in options if o["memory_bytes"] <= free]
    if fits:
        advice = "it fits with " + "; or with ".join(option_text(o) for o in fits)
    else:
        closest = min(options, key=lambda o: o["memory_bytes"], default=None)
        advice = ("use a smaller model, fewer prompts or samples, a smaller batch, or a device with "
                  "more memory" + (f" (with {option_text(closest)}, still too much)" if closest else ""))
    raise SpecError(_errors({
        "field": "memory",
        "message": f"this job needs about {size_text(need)} of memory at its peak (estimated from "
                   f"the model's size); {has}: {advice}",
        "limit": free, "value": need, "options": fits,
    }))


def _time_text(est: dict[str, Any]) -> str:
    if est.get("seconds") is None:
        return ""
    return f", about {duration(est['seconds'])} ({est.get('seconds_from') or 'measured throughput'})"


def _ceiling_text(ceiling: float, seconds: float | None) -> str:
    return f"{duration(seconds)} ({ceiling:.3g})" if seconds is not None else f"{ceiling:.3g}"


def describe(est: dict[str, Any], ceiling: float | None = None, seconds: float | None = None) -> str:
    """One line for the UI form and messages (`seconds`: the time limit the ceiling comes from)."""
    if est["cost"] is None:
        what = ", ".join(est["unknown_models"]) or "model"
        return (f"estimated cost: unknown (cannot count the parameters of {what}); "
                f"{est['token_passes']:.3g} token-passes")
    line = (f"estimated cost: {est['cost']:.3g} parameter-token-passes "
            f"({est['token_passes']:.3g} token-passes x {est['params']:,} parameters)"
            + _time_text(est))
    if est.get("memory_bytes"):
        line += f"; {memory_text(est)}{host_text(est)}"
    if est.get("memory_fits") is False:
        line += " (more than the device has free" + "".join(
            f"; with {option_text(o)}" for o in est.get("memory_options") or []) + ")"
    if ceiling is not None:
        line += f"; your per-job ceiling: {_ceiling_text(ceiling, seconds)}"
    return line


def within_ceiling(est: dict[str, Any], ceiling: float | None, seconds: float | None = None) -> bool:
    """Whether an estimate is within a ceiling: a run-time limit compares the estimated run time
    (the calibrated model when there is one), a cost ceiling the cost. Unknown cost: not within."""
    if ceiling is None:
        return True
    if est["cost"] is None:
        return False
    if seconds is not None and est.get("seconds") is not None:
        return float(est["seconds"]) <= seconds
    return float(est["cost"]) <= ceiling


def check_cost(est: dict[str, Any], ceiling: float | None, seconds: float | None = None) -> None:
    """SpecError (422) when the estimate is over the ceiling, or unknown while one applies
    (`seconds`: the run-time limit the ceiling comes from, named in the message)."""
    if ceiling is None:
        return
    if est["cost"] is None:
        fields = est["unknown_models"] or ["model"]
        raise SpecError(_errors(*({
            "field": f,
            "message": ("cannot estimate this job's cost: the parameter count of this model is "
                        "unknown here (hub id, or no safetensors weights)")
            + f"; a per-job ceiling of {_ceiling_text(ceiling, seconds)} applies to you, so ask an "
            "admin to run it",
            "limit": ceiling, "value": None,
        } for f in fields)))
    if not within_ceiling(est, ceiling, seconds):
        raise SpecError(_errors({
            "field": "spec",
            "message": f"estimated cost {est['cost']:.3g} parameter-token-passes "
                       f"({est['token_passes']:.3g} token-passes x {est['params']:,} parameters"
                       f"{_time_text(est)}) exceeds your per-job ceiling of "
                       f"{_ceiling_text(ceiling, seconds)}; use fewer prompts, samples, steps or "
                       "tokens, or ask an admin to raise your limit",
            "limit": ceiling, "value": est["cost"],
        }))


def check_active(active: int, limit: int | None) -> None:
    """QuotaExceeded (429) when a user already has `limit` queued or running jobs."""
    if limit is not None and active >= limit:
        raise QuotaExceeded(_errors({
            "field": "jobs",
            "message": f"you have {active} queued or running jobs; the limit is {limit} per user. "
                       "Wait for one to finish or cancel one",
            "limit": limit, "value": active,
        }))


# ---------------------------------------------------------------- spec size


def check_spec_size(data: Any, *, max_keys: int, max_string: int, max_list: int = 64,
                    max_depth: int = 3) -> None:
    """SpecError naming the field when a submitted spec is oversized (before validation, so an
    abusive spec costs nothing to refuse)."""
    if not isinstance(data, dict):
        return
    if len(data) > max_keys:
        raise SpecError(_errors({"field": "spec", "message": f"has {len(data)} keys; at most {max_keys}",
                          "limit": max_keys, "value": len(data)}))

    def walk(v: Any, path: str, depth: int) -> None:
        if depth > max_depth:
            raise SpecError(_errors({"field": path, "message": f"nested deeper than {max_depth} levels"}))
        if isinstance(v, str) and len(v) > max_string:
            raise SpecError(_errors({"field": path, "message": f"is {len(v)} characters long; at most "
                              f"{max_string}", "limit": max_string, "value": len(v)}))
        if isinstance(v, list):
            if len(v) > max_list:
                raise SpecError(_errors({"field": path, "message": f"has {len(v)} items; at most {max_list}",
                                  "limit": max_list, "value": len(v)}))
            for i, x in enumerate(v):
                walk(x, f"{path}.{i}", depth + 1)
        if isinstance(v, dict):
            if len(v) > max_keys:
                raise SpecError(_errors({"field": path, "message": f"has {len(v)} keys; at most {max_keys}"}))
            for k, x in v.items():
                walk(k, path, depth + 1)
                walk(x, f"{path}.{k}", depth + 1)

    for key, value in data.items():
        if isinstance(key, str) and len(key) > 100:
            raise SpecError(_errors({"field": "spec", "message": f"a key is {len(key)} characters long; "
                              "at most 100"}))
        walk(value, str(key), 1)


def form_estimate_html(settings: Any, kind: str, data: dict[str, Any]) -> str:
    """The cost line under a job form (UI), for the signed-in user's ceiling: shown before
    submitting, refreshed as the form changes. Never raises."""
    import html

    from app import auth
    try:
        spec = registry.parse_spec(kind, data)
    except SpecError as exc:
        first = exc.errors[0] if exc.errors else {"field": "spec", "message": "invalid"}
        return (f"<div class='fl-cost' data-within='unknown'>estimated cost: fix "
                f"<b>{html.escape(str(first['field']))}</b> first</div>")
    try:
        user = auth.current_user(settings)
        ceiling, seconds = user.max_job_cost, user.max_job_seconds
        est = estimate(settings, kind, spec, refs_for_estimate(settings, kind, spec))
    except Exception as exc:  # noqa: BLE001 - a hint line must never break the form
        return f"<div class='fl-cost' data-within='unknown'>estimated cost: unavailable ({html.escape(type(exc).__name__)})</div>"
    within = within_ceiling(est, ceiling, seconds)
    over = "" if within else " <b>over your ceiling: it would be refused</b>"
    return (f"<div class='fl-cost' data-within='{'yes' if within else 'no'}' "
            f"data-cost='{est['cost'] if est['cost'] is not None else ''}'>"
            f"{html.escape(describe(est, ceiling, seconds))}{over}</div>")
