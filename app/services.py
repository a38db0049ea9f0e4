"""What the CLI, the REST API and the UI do with jobs: submit, reuse, cancel, rerun, look up.

No torch here (the web process imports this). Tasks are sent by name with only the job id.
Every function takes `settings` (app.settings.Settings) and returns plain dicts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from compute.celery_app import send_job
from compute.modelref import (
    ARTIFACT_FIELDS,
    MODEL_FIELDS,
    file_sha256,
    job_ref_id,
    model_revision,
    resolve_job_ref,
    resolve_model,
    spec_job_refs,
)
from compute.specs import SpecError, parse_spec
from storage import repo
from storage import users as user_repo
from storage.db import session_factory, upgrade
from storage.models import FINAL_STATUSES, revision_digest

_upgraded: set[str] = set()
_upgrade_lock = threading.Lock()


def sessions(settings: Any) -> sessionmaker[Session]:
    """The session factory for settings.db_url, migrating the schema once per process."""
    url = settings.db_url
    with _upgrade_lock:
        if url not in _upgraded:
            upgrade(url)
            _upgraded.add(url)
    return session_factory(url)


def share_url(settings: Any, token: str) -> str:
    return f"{settings.public_url.rstrip('/')}/r/{token}"


def _public(settings: Any, job_dict: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A job dict: `message` is one line with no server path. `error` (the traceback) is for
    operators (the CLI, tests, the worker log): web responses drop it (without_error)."""
    out = dict(job_dict)
    out["message"] = public_message(out.get("message"))
    out["share_url"] = share_url(settings, job_dict["share_token"])
    out.update(extra)
    return out


def without_error(data: Any) -> Any:
    """A job dict, a list of them or a result dict as the web shows it: no `error` field."""
    if isinstance(data, list):
        return [without_error(d) for d in data]
    if isinstance(data, dict):
        out = {k: v for k, v in data.items() if k != "error"}
        if isinstance(out.get("job"), dict):
            out["job"] = without_error(out["job"])
        return out
    return data


_SERVER_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.\-+@~]+){2,}/?")


def public_message(message: Any, limit: int = 500) -> str:
    """One line a user can act on: the last line of a traceback, server paths as <path>."""
    text = str(message or "").strip()
    if "Traceback (most recent call last)" in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        text = lines[-1] if lines else ""
    text = text.splitlines()[0] if text else ""
    text = _SERVER_PATH.sub("<path>", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    errors: list[dict[str, str]] = []
    parts: list[str] = []
    found: dict[str, Path] = {}  # field -> local model folder or artifact file
    needs_db = bool(spec_job_refs(kind, spec))
    with sessions(settings)() if needs_db else contextlib.nullcontext() as s:
        for field in MODEL_FIELDS:
            ref = getattr(spec, field, None)
            if not ref and field == "teacher" and kind == "retention" and spec.algo == "opd":
                from compute.specs import DEFAULT_TEACHERS

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
    if not errors:
        errors += _compatibility(kind, found, getattr(spec, "algo", None))
    task = getattr(spec, "task", None)
    if isinstance(task, str) and task.startswith("jsonl:"):
        try:
            _check_jsonl(settings, task, local)
        except ValueError as exc:
            errors.append(_field_error("task", exc))
    if errors:
        raise SpecError(errors)
    return parts


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


def _model_config(settings: Any, s: Any, ref: str) -> dict[str, Any] | None:
    """config.json of a local or zoo model or a trained model (None for hub ids): read as JSON,
    no torch, no weights."""
    folder = (
        resolve_job_ref(ref, "model", settings, s).path
        if job_ref_id(ref) is not None
        else Path(resolve_model(ref, settings))
    )
    if not folder.is_absolute():
        return None
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise ValueError(f"model: {ref!r} has no readable config.json") from None
    return cfg if isinstance(cfg, dict) else None


def _check_layer(settings: Any, s: Any, ref: str, layer: int) -> None:
    cfg = _model_config(settings, s, ref)
    if cfg is None:
        return
    n = next(
        (cfg[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(cfg.get(k), int)),
        None,
    )
    if n is not None and not 0 <= layer < n:
        raise ValueError(f"layer: got {layer}; accepted range: >= 0, <= {n - 1} (the model has {n} blocks)")


def _safetensors_header(path: Path) -> None:
    """ValueError unless `path` starts like a safetensors file (length + JSON header)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= 100_000_000:
                raise ValueError("is not a safetensors file")
            header = json.loads(fh.read(n))
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("is not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict) or not any(k != "__metadata__" for k in header):
        raise ValueError("is a safetensors file with no tensors")


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path.is_relative_to(Path(r).expanduser().resolve()) for r in roots)


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
        if not local and not _inside(resolved, [settings.artifacts_dir, *settings.model_roots]):
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
        _safetensors_header(resolved)
    except ValueError as exc:
        raise ValueError(f"{ref!r} {exc}") from None
    return resolved


def _model_folder(settings: Any, s: Any, field: str, ref: str) -> Path | None:
    """The local folder of a model reference (None for a hub id)."""
    if job_ref_id(ref) is not None:
        return resolve_job_ref(ref, field, settings, s).path
    resolved = Path(resolve_model(ref, settings))
    return resolved if resolved.is_absolute() else None


def _shapes(path: Path) -> dict[str, tuple[int, ...]] | None:
    """name -> shape from safetensors headers (no tensor is read, no torch): a file, or a model
    folder (model.safetensors or the shards of its index). None when there are no such files."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        try:
            if index.is_file():
                shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
                files = [path / f for f in shards]
            else:
                files = [path / "model.safetensors"]
        except (OSError, json.JSONDecodeError, AttributeError):
            return None
    else:
        files = [path]
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with f.open("rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 2 <= n <= 100_000_000 else None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(header, dict):
            return None
        for k, v in header.items():
            if k != "__metadata__" and isinstance(v, dict):
                out[k] = tuple(v.get("shape") or ())
    return out


def _fits(field: str, part: dict[str, tuple[int, ...]], whole: dict[str, tuple[int, ...]],
          whose: str) -> str | None:
    """Why tensors `part` (a Fisher or mask) do not belong to checkpoint `whole`, or None."""
    for name, shape in part.items():
        if name not in whole:
            if name.endswith("lm_head.weight"):  # tied output layer: saved once, as the embedding
                continue
            return f"parameter {name!r} is not in {whose}; was it made for another model?"
        if whole[name] != shape:
            return (f"parameter {name!r} has shape {list(shape)} here but {list(whole[name])} "
                    f"in {whose}")
    return None


def _vocab(folder: Path) -> dict[str, int] | None:
    try:
        tok = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {str(p[0]): i for i, p in enumerate(vocab)}
    if not isinstance(vocab, dict):
        return None
    return {**vocab, **{t["content"]: t["id"] for t in tok.get("added_tokens") or []}}


def _compatibility(kind: str, found: dict[str, Path], algo: str | None) -> list[dict[str, str]]:
    """What the worker would refuse about two references together: a Fisher or mask made for
    another model, base and tuned of different architectures, a teacher with another tokenizer."""
    shapes = {f: _shapes(p) for f, p in found.items()}
    errors = []

    def check(field: str, model_field: str, whose: str) -> None:
        part, whole = shapes.get(field), shapes.get(model_field)
        if part is not None and whole is not None:
            why = _fits(field, part, whole, whose)
            if why:
                errors.append({"field": field, "message": why})

    if kind in ("mask", "train"):
        check("fisher", "model", "the model")
        check("mask", "model", "the model")
    if kind == "diff":
        base, tuned = shapes.get("base"), shapes.get("tuned")
        if base is not None and tuned is not None:
            why = _fits("tuned", tuned, base, "base") or _fits("base", base, tuned, "tuned")
            if why:
                errors.append({"field": "tuned", "message": "different architecture: " + why})
        check("fisher", "base", "the checkpoints")
    if algo == "opd" and "teacher" in found and "model" in found:
        vs, vt = _vocab(found["model"]), _vocab(found["teacher"])
        if vs is not None and vt is not None and vs != vt:
            errors.append({"field": "teacher", "message": "its tokenizer differs from the model's "
                           f"(vocab {len(vt)} vs {len(vs)}); on-policy distillation needs the same "
                           "tokenizer"})
    return errors


def _check_jsonl(settings: Any, task: str, local: bool) -> None:
    from compute.tasks import get_task

    raw = task[len("jsonl:"):].partition("?")[0]
    path = Path(raw).expanduser()
    if not local and not path.is_absolute():
        raise ValueError(f"jsonl file {raw!r}: give an absolute path")
    try:
        resolved = path.resolve()
        if not local and not _inside(resolved, list(settings.model_roots)):
            raise ValueError(
                f"jsonl file {raw!r} is outside the allowed roots; the operator can add folders "
                "with ALLOWED_MODEL_ROOTS=/a:/b"
            )
        if not resolved.is_file():
            raise ValueError(f"jsonl file {raw!r} does not exist")
        get_task(task).examples(1, split="train")  # parses every line; needs a train example
    except OSError as exc:
        raise ValueError(f"jsonl file {raw[:80]!r} cannot be read ({exc.strerror})") from None


def submit(settings: Any, kind: str, data: dict[str, Any], *, reuse: bool = True) -> dict[str, Any]:
    """Validate, reuse an identical succeeded job, or create a job row and queue it.

    Returns the job dict plus "share_url" and "reused" (True when an earlier result is returned
    instead of computing again). Raises compute.specs.SpecError (nothing queued) on bad input.
    """
    from app import auth, limits

    user = auth.current_user(settings)  # accounts: owner, quotas and cost ceiling (app/limits.py)
    limits.check_spec_size(data, max_keys=settings.max_spec_keys, max_string=settings.max_spec_string)
    auth.check_refs_owned(settings, user, kind, parse_spec(kind, data))
    spec, parts = validate(settings, kind, data)
    limits.check_cost(limits.estimate(settings, kind, spec), user.max_job_cost)
    spec_hash = spec.spec_hash()
    revision = revision_digest(parts)
    with sessions(settings)() as s:
        if reuse:
            old = repo.find_reusable(
                session=s, kind=kind, spec_hash=spec_hash, model_revision=revision,
                owner_id=user.id if settings.auth_required else None,
            )
            if old is not None:
                return _public(settings, repo.job_dict(old), reused=True)
        limits.check_active(user_repo.active_jobs(session=s, owner_id=user.id), user.max_active_jobs)
        job = repo.create_job(
            owner_id=user.id,
            session=s,
            kind=kind,
            spec=spec.model_dump(mode="json"),
            spec_hash=spec_hash,
            model_revision=revision,
            revisions=parts,
        )
        out = repo.job_dict(job)
    try:
        send_job(settings, out["id"])
    except Exception as exc:  # broker down: the row must not claim to be queued forever
        with sessions(settings)() as s:
            repo.mark_failed(
                session=s,
                job_id=out["id"],
                error=f"could not queue the job: {exc!r}",
                message="could not reach the job queue (broker); is Redis running?",
            )
        raise RuntimeError(f"could not queue job {out['id']}: {exc}") from exc
    return _public(settings, out, reused=False)


def get_job(settings: Any, job_id: int) -> dict[str, Any] | None:
    """The job, or None when it does not exist or belongs to another user (non-admin)."""
    from app import auth

    user = auth.current_user(settings)
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        ok = job is not None and auth.can_see(user, job.owner_id)
        return _public(settings, repo.job_dict(job)) if job is not None and ok else None


def list_jobs(
    settings: Any, limit: int = 100, owner: str | None = None, **filters: Any
) -> list[dict[str, Any]]:
    """Newest first: the caller's own jobs (admins: everyone's, or owner=NAME / 'me')."""
    from app import auth

    owner_id = auth.owner_filter(settings, auth.current_user(settings), owner)
    with sessions(settings)() as s:
        return [
            _public(settings, repo.job_dict(j))
            for j in repo.list_jobs(session=s, limit=limit, owner_id=owner_id, **filters)
        ]


def trained_models(settings: Any, limit: int = 100) -> list[dict[str, Any]]:
    """Succeeded train jobs whose saved model is in the artifact store, newest first, as model
    choices: {"ref": "job:6", "label": "#6 train arith-base grpo masked", "job_id": 6, "spec"}.
    Any model field (model, teacher, base, tuned) accepts the ref."""
    from compute.modelref import trained_model_label

    jobs = list_jobs(settings, limit=limit, kind="train", status="succeeded")
    out = []
    with sessions(settings)() as s:
        for j in jobs:
            if repo.get_artifact(session=s, job_id=j["id"], kind="model") is None:
                continue
            out.append({"ref": f"job:{j['id']}", "label": trained_model_label(j["id"], j["spec"]),
                        "job_id": j["id"], "spec": j["spec"]})
    return out


def result_by_token(settings: Any, token: str) -> dict[str, Any] | None:
    """GET /api/results/{token}: the job and all its stored rows, or None for unknown tokens."""
    from app import auth

    with sessions(settings)() as s:
        job = repo.get_job_by_token(session=s, token=token)
        if job is None or not auth.can_read_result(settings, job):
            return None
        out = repo.result_dict(session=s, job=job)
        out["job"] = _public(settings, out["job"])
        return out


def result_by_id(settings: Any, job_id: int) -> dict[str, Any] | None:
    from app import auth

    user = auth.current_user(settings)
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        if job is None or not auth.can_see(user, job.owner_id):
            return None
        out = repo.result_dict(session=s, job=job)
        out["job"] = _public(settings, out["job"])
        return out


def cancel(settings: Any, job_id: int) -> dict[str, Any]:
    """Cancel a queued job now, or ask a running one to stop; LookupError if there is none."""
    from app import auth

    user = auth.current_user(settings)
    with sessions(settings)() as s:
        found = repo.get_job(session=s, job_id=job_id)
        if found is None or not auth.can_see(user, found.owner_id):
            raise LookupError(f"job: no job with id {job_id}")
        job = repo.request_cancel(session=s, job_id=job_id)
        return _public(settings, repo.job_dict(job))


def rerun(settings: Any, job_id: int) -> dict[str, Any]:
    """A new job with the same kind and spec, computed again (no reuse). LookupError if the job
    does not exist; ValueError if it is still queued or running."""
    from app import auth

    user = auth.current_user(settings)
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        if job is None or not auth.can_see(user, job.owner_id):
            raise LookupError(f"job: no job with id {job_id}")
        if job.status not in FINAL_STATUSES:
            raise ValueError(f"job: job {job_id} is still {job.status}; cancel it first")
        kind, spec = job.kind, dict(job.spec)
    return submit(settings, kind, spec, reuse=False)


def list_models(settings: Any) -> list[dict[str, Any]]:
    with sessions(settings)() as s:
        return [repo.model_dict(m) for m in repo.list_models(session=s)]


def artifact_path(settings: Any, token: str, kind: str) -> Path | None:
    """The verified file of a job's artifact (for downloads), or None when there is none.
    Raises FileNotFoundError when the file is gone (HTTP 410) and
    storage.artifacts.ArtifactError when it does not match its sha256 (HTTP 409)."""
    from app import auth
    from storage.artifacts import ArtifactStore

    with sessions(settings)() as s:
        job = repo.get_job_by_token(session=s, token=token)
        if job is None or not auth.can_read_result(settings, job):
            return None
        art = repo.get_artifact(session=s, job_id=job.id, kind=kind)
        if art is None:
            return None
        store = ArtifactStore(settings.artifacts_dir)
        if not store.resolve(art.path).exists():
            raise FileNotFoundError(f"artifact {kind} of job {job.id} is no longer stored")
        return store.verify(art.path, art.sha256)


def set_sharing(settings: Any, job_id: int, action: str) -> dict[str, Any]:
    """The owner's control of a result's share link: 'new' (a new token: the old link answers
    404 from now on), 'off' (the link stops working; the owner still sees the result) or 'on'.
    LookupError for another user's job (non-admin), ValueError for another action."""
    from app import auth

    if action not in ("new", "off", "on"):
        raise ValueError(f"action: got {action!r}; accepted: new, off, on")
    user = auth.current_user(settings)
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        if job is None or not auth.can_see(user, job.owner_id):
            raise LookupError(f"job: no job with id {job_id}")
        job = repo.set_sharing(session=s, job_id=job_id, new_token=action == "new",
                               shared=action != "off")
        return _public(settings, repo.job_dict(job))
