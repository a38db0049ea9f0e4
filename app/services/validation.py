"""The one validation path of the API, the UI and `fisherlens submit`: what the spec alone
cannot say (model and artifact references, layer ranges, jsonl task files). Messages name the
field and echo the user's input, never a server path."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from app.services.common import sessions
from app.services.compat import check_safetensors, compatibility
from compute.contract.modelref import (
    ARTIFACT_FIELDS,
    MODEL_FIELDS,
    file_sha256,
    inside_roots,
    job_ref_id,
    model_revision,
    resolve_job_ref,
    resolve_model,
    spec_job_refs,
)
from compute.contract.specs import SpecError, parse_spec
from storage.artifacts import open_store

Errors = list[dict[str, str]]


def validate(settings: Any, kind: str, data: dict[str, Any]) -> tuple[Any, list[str]]:
    """(spec, revision parts) or SpecError naming each bad field: the one validation path of the
    API, the UI and `fisherlens submit` (the direct CLI commands call check_spec with local=True).
    Nothing that passes is refused by a worker for its input."""
    spec = parse_spec(kind, data)  # types, ranges, cross-field rules, task names and options
    return spec, check_spec(settings, kind, spec)


def check_spec(settings: Any, kind: str, spec: Any, *, local: bool = False) -> list[str]:
    """What the spec alone cannot say: model references (allowed roots, zoo built, job:N of a
    succeeded train job), layer ranges against the model's config.json, artifact references
    (job:N: exists, succeeded, right kind, readable artifact; files: inside the allowed roots,
    readable safetensors) and jsonl: task files (inside the allowed roots, every line valid).
    `local` (the CLI's direct commands, run as the user): any readable file is accepted.
    Returns the revision parts (one per referenced model or artifact); SpecError otherwise.
    Messages name the field and echo the user's input, never a server path."""
    errors: Errors = []
    parts: list[str] = []
    found: dict[str, Path] = {}  # field -> local model folder or artifact file
    needs_db = bool(spec_job_refs(kind, spec))
    with sessions(settings)() if needs_db else contextlib.nullcontext() as s:
        _check_models(settings, s, kind, spec, local, parts, found, errors)
        _check_artifacts(settings, s, kind, spec, local, parts, found, errors)
    if not errors:
        errors += compatibility(kind, found, getattr(spec, "algo", None))
    task = getattr(spec, "task", None)
    if isinstance(task, str) and task.startswith("jsonl:"):
        try:
            _check_jsonl(settings, task, local)
        except ValueError as exc:
            errors.append(_field_error("task", exc))
    if errors:
        raise SpecError(errors)
    return parts


def _check_models(
    settings: Any, s: Any, kind: str, spec: Any, local: bool,
    parts: list[str], found: dict[str, Path], errors: Errors,
) -> None:  # fmt: skip
    """Model references of `spec`: revision parts, local folders and field errors appended."""
    for field in MODEL_FIELDS:
        ref = getattr(spec, field, None)
        if not ref and field == "teacher" and kind == "retention" and spec.algo == "opd":
            from compute.contract.specs import DEFAULT_TEACHERS

            ref = DEFAULT_TEACHERS.get(spec.model)  # what the worker would load
        if not ref:
            continue
        try:
            parts.append(f"{field}={_model_revision(settings, s, field, ref, local)}")
            folder = _model_folder(settings, s, field, ref)
            if folder is not None:
                found[field] = folder
        except ValueError as exc:
            errors.append(_field_error(field, exc))
            continue
        if field == "model" and getattr(spec, "layer", None) is not None:
            try:
                _check_layer(settings, s, ref, int(spec.layer))
            except ValueError as exc:
                errors.append(_field_error("layer", exc))


def _check_artifacts(
    settings: Any, s: Any, kind: str, spec: Any, local: bool,
    parts: list[str], found: dict[str, Path], errors: Errors,
) -> None:  # fmt: skip
    """Fisher/mask/gradient references of `spec`, like _check_models."""
    for field in ARTIFACT_FIELDS.get(kind, ()):
        ref = getattr(spec, field, None)
        if not ref:
            continue
        try:
            path = _artifact_file(settings, s, field, ref, local)
            parts.append(f"{field}={_artifact_revision(settings, s, field, ref, path)}")
            found[field] = path
        except ValueError as exc:
            errors.append(_field_error(field, exc))


def _field_error(field: str, exc: Exception) -> dict[str, str]:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for prefix in (f"{field}: ", "model: ", "task: "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
            break
    return {"field": field, "message": msg}


def _model_revision(settings: Any, s: Any, field: str, ref: str, local: bool = False) -> str:
    """The revision part of a model reference; ValueError if it cannot be used. `local` (a
    direct CLI run, nothing stored) only resolves the reference: no hashing of the weights."""
    if job_ref_id(ref) is not None:
        art = resolve_job_ref(ref, field, settings, s)
        return f"job:{art.job_id}:{art.sha256}"
    rev = resolve_model(ref, settings) if local else model_revision(ref, settings)
    if not Path(resolve_model(ref, settings)).is_absolute():
        _check_hub_cached(ref)
    return rev


def _check_hub_cached(repo_id: str) -> None:
    """Offline (HF_HUB_OFFLINE=1), a hub id is usable only if its files are in the local cache."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes"):
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        raise ValueError(f"hub model {repo_id!r} is not in the local cache and this server is "
                         "offline (HF_HUB_OFFLINE=1); give a zoo name, a local folder or job:N")


def _model_folder(settings: Any, s: Any, field: str, ref: str) -> Path | None:
    """The local folder of a model reference (None for a hub id)."""
    if job_ref_id(ref) is not None:
        return resolve_job_ref(ref, field, settings, s).path
    resolved = Path(resolve_model(ref, settings))
    return resolved if resolved.is_absolute() else None


def _check_layer(settings: Any, s: Any, ref: str, layer: int) -> None:
    """ValueError when `layer` is not a block of the model (read from its config.json as JSON,
    no torch, no weights; hub ids are not checked)."""
    folder = _model_folder(settings, s, "model", ref)
    if folder is None:
        return
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise ValueError(f"model: {ref!r} has no readable config.json") from None
    if not isinstance(cfg, dict):
        return
    n = next(
        (cfg[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(cfg.get(k), int)),
        None,
    )
    if n is not None and not 0 <= layer < n:
        raise ValueError(f"layer: got {layer}; accepted range: >= 0, <= {n - 1} (the model has {n} blocks)")


def _artifact_revision(settings: Any, s: Any, field: str, ref: str, path: Path) -> str:
    """The revision part of a fisher/mask/gradient reference ('job:<id>' or a file)."""
    if ref.strip().startswith("job:"):
        art = resolve_job_ref(ref.strip(), field, settings, s)
        return f"job:{art.job_id}:{art.sha256}"
    return f"file:{file_sha256(path)}"


def _artifact_file(settings: Any, s: Any, field: str, ref: str, local: bool) -> Path:
    """The readable safetensors file of a fisher/mask/gradient reference; ValueError if none."""
    ref = ref.strip()
    if ref.startswith("job:"):
        return resolve_job_ref(ref, field, settings, s).path
    path = Path(ref).expanduser()
    if not local and not path.is_absolute():
        raise ValueError(f"{ref!r}: give an absolute path, or job:<id> of a {field} job")
    try:
        resolved = path.resolve()
        if not local and not inside_roots(resolved, [*open_store(settings).local_roots(), *settings.model_roots]):
            raise ValueError(
                f"{ref!r} is outside the artifact store and the allowed model roots; "
                f"use job:<id> of a {field} job"
            )
        if resolved.is_dir() and (resolved / f"{field}.safetensors").is_file():
            resolved = resolved / f"{field}.safetensors"
        if not resolved.is_file():
            raise ValueError(f"{ref!r}: file does not exist")
    except OSError as exc:
        raise ValueError(f"{ref[:80]!r}: not a usable path ({exc.strerror})") from None
    try:
        check_safetensors(resolved)
    except ValueError as exc:
        raise ValueError(f"{ref!r} {exc}") from None
    return resolved


def _check_jsonl(settings: Any, task: str, local: bool) -> None:
    from compute.tasks import get_task

    raw = task[len("jsonl:"):].partition("?")[0]
    path = Path(raw).expanduser()
    if not local and not path.is_absolute():
        raise ValueError(f"jsonl file {raw!r}: give an absolute path")
    try:
        resolved = path.resolve()
        if not local and not inside_roots(resolved, list(settings.model_roots)):
            raise ValueError(
                f"jsonl file {raw!r} is outside the allowed roots; the operator can add folders "
                "with ALLOWED_MODEL_ROOTS=/a:/b"
            )
        if not resolved.is_file():
            raise ValueError(f"jsonl file {raw!r} does not exist")
        get_task(task).examples(1, split="train")  # parses every line; needs a train example
    except OSError as exc:
        raise ValueError(f"jsonl file {raw[:80]!r} cannot be read ({exc.strerror})") from None

