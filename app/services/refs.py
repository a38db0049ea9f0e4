"""The one reference resolver: every form a spec field can name (a zoo name, a local folder, a
hub id, `job:N`, a file path) becomes a typed `Ref` (compute.contract.kinds) here, once, at
validation; who may use it is part of resolving.

    resolve_values(settings, spec_values(kind, spec), user) -> ({field: Ref}, [field errors])

(app.services.validation.check_spec turns the errors into one SpecError naming each field.)

The Refs are stored with the job (`jobs.refs`); the worker receives them and only re-verifies
their sha256 through `storage.artifacts.open_store(settings).fetch(path, sha256)`; the engine
never opens the database and never resolves a reference again. The API, the UI, `fisherlens
submit`, the CLI's direct commands (`local=True`), /api/estimate and model registration all call
this module.

Rules (messages name the field, echo the user's input and never a server path):
- `job:N`: job N exists, succeeded, is of a kind that provides this field's target, its artifact
  is present and matches its sha256, and, with AUTH_REQUIRED, the caller owns it or is an admin.
  Another user's job is answered exactly like a job that does not exist. A share link grants
  reading a result, not reusing its artifacts.
- A plain path inside the artifact store (`<artifact root>/1/fisher.safetensors`, the folder
  `<artifact root>/1`, a symlink into it) is refused with "write job:1": artifacts are named by
  job reference, which is where ownership is checked.
- A model: a zoo name, a folder inside the allowed model roots (any folder for the CLI's direct
  commands), or a hub id (offline: only when cached). A model whose config.json asks for remote
  code (`auto_map`) is refused unless the operator set TRUST_REMOTE_CODE.
- A fisher / mask / gradient file: an absolute path inside the allowed model roots (any readable
  path for the CLI's direct commands) of a safetensors file holding tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from compute.contract import modelref as mr
from compute.contract.kinds import Ref, RefForm, RefTarget

STORE_DOWN = "the artifact store cannot be reached right now; try again in a minute"


def ref_fields(kind: str) -> dict[str, RefTarget]:
    """Spec field -> what it names, for every reference field of job kind `kind`: the kind's
    `KIND.refs` (compute/jobs/<kind>.py), the one place that says which fields are references."""
    from compute.jobs import registry

    return dict(registry.get(kind).refs)


def job_outputs(field: str, target: RefTarget) -> tuple[tuple[str, ...], str]:
    """(job kinds whose `job:N` can fill a field of `target`, the artifact kind it reads): the
    kinds whose KIND.outputs has `target`. Every producer stores it under the same artifact kind
    (compute/jobs/registry.py checks)."""
    from compute.jobs import registry

    kinds = registry.producers(target)
    arts = {registry.get(k).outputs[target] for k in kinds}
    return kinds, (arts.pop() if len(arts) == 1 else target)


def spec_values(kind: str, spec: Any) -> dict[str, tuple[str, RefTarget]]:
    """field -> (what the spec names, its target) for the reference fields the spec fills
    (compute.jobs.registry.ref_values: the one list, shared with library callers)."""
    from compute.jobs import registry

    return registry.ref_values(kind, spec)


# -- the whole spec ----------------------------------------------------------------------------
def resolve_values(
    settings: Any, values: dict[str, tuple[str, RefTarget]], user: Any = None, *,
    local: bool = False, hash_models: bool = True,
) -> tuple[dict[str, Ref], list[dict[str, str]]]:  # fmt: skip
    """({field: Ref}, [{"field", "message"}, ...]) for field -> (value, target): every reference
    of a spec (see the module docstring). `user` is the caller (app.auth Principal; None:
    anonymous, or the operator for the CLI's direct commands). `hash_models=False` skips hashing
    model weights (estimates, direct CLI runs); artifacts are always checked against their
    sha256."""
    refs: dict[str, Ref] = {}
    errors: list[dict[str, str]] = []
    needs_db = any(mr.job_ref_id(v) is not None for v, _ in values.values())
    with _session(settings) if needs_db else contextlib.nullcontext() as s:
        for field, (value, target) in values.items():
            try:
                refs[field] = resolve(settings, field, value, target, user, session=s,
                                      local=local, hash_models=hash_models)
            except ValueError as exc:
                errors.append(field_error(field, exc))
    return refs, errors


def revision_parts(refs: dict[str, Ref]) -> list[str]:
    """One part per reference, in field order: what makes two jobs with the same spec the same
    computation ('model=<folder sha256>', 'mask=job:3:<sha256>', 'fisher=file:<sha256>')."""
    parts = []
    for field, r in refs.items():
        if r.form == "artifact":
            parts.append(f"{field}=job:{r.job_id}:{r.sha256}")
        elif r.form == "hub":
            parts.append(f"{field}={r.path}")
        elif r.target == "model":
            parts.append(f"{field}={r.sha256 or r.path}")
        else:
            parts.append(f"{field}=file:{r.sha256}")
    return parts


def field_error(field: str, exc: Exception) -> dict[str, str]:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for prefix in (f"{field}: ", "model: ", "task: "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
            break
    return {"field": field, "message": msg}


@contextlib.contextmanager
def _session(settings: Any) -> Any:
    from app.services.common import sessions

    with sessions(settings)() as s:
        yield s


# -- one reference -----------------------------------------------------------------------------
def resolve(
    settings: Any, field: str, value: str, target: RefTarget, user: Any = None, *,
    session: Any = None, local: bool = False, hash_models: bool = True,
) -> Ref:  # fmt: skip
    """One reference -> Ref; ValueError "<field>: ..." when it cannot be used by `user`."""
    value = str(value).strip()
    if not value:
        raise ValueError(f"{field}: empty reference")
    n = mr.job_ref_id(value)
    if n is not None:
        if session is None:
            with _session(settings) as s:
                return _job_ref(settings, s, field, value, n, target, user, local)
        return _job_ref(settings, session, field, value, n, target, user, local)
    if value.startswith("job:"):
        raise ValueError(f"{field}: {value[:40]!r} is not a job reference; write job:<number>, e.g. job:3")
    _refuse_store_path(settings, field, value, target)
    if target == "model":
        return _model_ref(settings, field, value, local, hash_models)
    if target == "run_dir":
        return _run_dir_ref(settings, field, value, local, hash_models)
    return _file_ref(settings, field, value, target, local)


checkpoints = mr.checkpoints  # the checkpoint-<step> folders of a run folder, in step order


def _run_dir_ref(settings: Any, field: str, value: str, local: bool, hash_models: bool) -> Ref:
    """A run folder named by path: inside the allowed roots (any folder for the CLI's direct
    commands), holding at least one checkpoint-<step> folder; its sha256 hashes every
    checkpoint's weights, config and tokenizer (the worker re-verifies it)."""
    raw = Path(value).expanduser()
    if ".." in raw.parts:
        raise ValueError(f"{field}: {value!r} contains '..'; give a folder inside the allowed roots")
    try:
        folder = raw.resolve()
        if not local and not mr.inside_roots(folder, list(settings.model_roots)):
            raise ValueError(f"{field}: folder {value!r} is outside the allowed model roots; the "
                             "operator can add folders with ALLOWED_MODEL_ROOTS=/a:/b")
        if not folder.is_dir():
            raise ValueError(f"{field}: folder {value!r} does not exist")
        ckpts = checkpoints(folder)
    except OSError as exc:
        raise ValueError(f"{field}: {value[:80]!r}: not a usable path ({exc.strerror})") from None
    if not ckpts:
        raise ValueError(f"{field}: {value!r} holds no checkpoint-<step> folder (save with "
                         "save_steps, or fisherlens train --save-steps)")
    files = _checked_reads(settings, field, value, mr.read_files(folder, "run_dir"), local)
    sha = mr.run_dir_revision(folder) if hash_models else None
    return Ref(field=field, given=value, target="run_dir", form="local", path=str(folder),
               sha256=sha, files=mr.manifest(files) if hash_models else None, local=str(folder))


def _may_use(settings: Any, user: Any, owner_id: int | None, local: bool) -> bool:
    """Owners and admins use an artifact. Without AUTH_REQUIRED everything is the local user's;
    the CLI's direct commands (local, no signed-in user) run as the operator."""
    if not settings.auth_required:
        return True
    if user is None:
        return local
    return bool(user.is_admin) or (owner_id is not None and owner_id == user.id)


def _job_ref(
    settings: Any, s: Any, field: str, value: str, n: int, target: RefTarget, user: Any,
    local: bool,
) -> Ref:  # fmt: skip
    from storage import repo
    from storage.artifacts import (
        ArtifactError,
        ArtifactMissing,
        ArtifactStoreUnavailable,
        open_store,
    )

    kinds, art_kind = job_outputs(field, target)
    if not kinds:
        raise ValueError(f"{field}: job references are not accepted here; give a file")
    want = " or ".join(kinds)
    try:
        job = repo.get_job(session=s, job_id=n)
    except Exception:  # noqa: BLE001 - no jobs table yet (fresh database): nothing to point at
        job = None
    if job is None or not _may_use(settings, user, job.owner_id, local):
        # another user's job is answered exactly like one that does not exist
        raise ValueError(f"{field}: job {n} does not exist; give the id of one of your "
                         f"succeeded {want} jobs")
    if job.kind not in kinds:
        raise ValueError(f"{field}: job {n} is a {job.kind} job; a {want} job is needed")
    if job.status != "succeeded":
        raise ValueError(f"{field}: job {n} is {job.status}; only a succeeded {want} job can be used")
    art = repo.get_artifact(session=s, job_id=job.id, kind=art_kind)
    if art is None:
        raise ValueError(f"{field}: job {n} has no {art_kind} artifact")
    what = f"{field}: the {art_kind} of job {n}"
    try:
        path = open_store(settings).fetch(art.path, art.sha256)
    except ArtifactMissing:
        raise ValueError(f"{what} is missing from the artifact store (deleted?); re-run job {n}") from None
    except ArtifactStoreUnavailable as exc:  # 503 + Retry-After; the address goes to the log only
        import logging

        logging.getLogger("fisherlens.web").warning("artifact store unavailable for %s: %s", what, exc)
        raise ArtifactStoreUnavailable(STORE_DOWN) from None
    except ArtifactError:
        raise ValueError(f"{what} does not match its recorded sha256 (corrupt or changed); "
                         f"re-run job {n}") from None
    label = (mr.trained_model_label(job.id, dict(job.spec or {})) if art_kind == "model"
             else f"#{job.id} {job.kind}")
    return Ref(field=field, given=value, target=target, form="artifact", path=art.path,
               sha256=art.sha256, job_id=job.id, job_kind=job.kind, owner_id=job.owner_id,
               label=label, local=str(path))


_JOB_DIR = re.compile(r"^(\d{1,12})(?:/|$)")


def _refuse_store_path(settings: Any, field: str, value: str, target: RefTarget) -> None:
    """ValueError "... write job:N" when `value` is a path inside the artifact store (a file or
    folder of a job, or the store itself; symlinks followed)."""
    try:
        raw = Path(value).expanduser()
        if not (mr.looks_like_path(value) or raw.is_absolute() or raw.exists()):
            return
        resolved = raw.resolve()
    except (OSError, RuntimeError):
        return  # not a usable path: the form's own check says why
    hit = mr.protected_hit(resolved, protected_roots(settings))
    if hit is None:
        return
    raise ValueError(f"{field}: {value[:120]!r} is inside the artifact store; write {_job_of(hit)} "
                     f"(artifacts are named by job, which checks who may use them)")


def protected_roots(settings: Any) -> list[Path]:
    """The artifact store's folders and cache (storage.artifacts.protected_roots)."""
    from storage.artifacts import protected_roots as roots

    return roots(settings)


def _job_of(relative: str) -> str:
    """'job:3' for a path relative to the store ('3/model/model.safetensors'), else 'job:<id>'."""
    m = _JOB_DIR.match(relative)
    return f"job:{m.group(1)}" if m else "job:<id>"


def _checked_reads(
    settings: Any, field: str, value: str, files: dict[str, Path], local: bool,
) -> dict[str, Path]:  # fmt: skip
    """`files` (name -> path, what the job will read) when every one, links followed, is inside
    the allowed model roots (any place for the CLI's direct commands), none is in the artifact
    store or its cache, none is a hard link to a store file (same device and inode), and no
    weight index names a shard outside the folder; else ValueError naming the field and the
    file, never where a link points."""
    protected = protected_roots(settings)
    roots = None if local else list(settings.model_roots)
    shared: list[tuple[str, os.stat_result]] = []
    for name, p in files.items():
        hit = mr.protected_hit(p, protected)
        if hit is not None:
            raise ValueError(f"{field}: {value[:120]!r}: {name!r} links into the artifact store; write "
                             f"{_job_of(hit)} (artifacts are named by job, which checks who may use them)")
        if roots is not None and not mr.inside_roots(Path(os.path.realpath(p)), roots):
            raise ValueError(f"{field}: {value[:120]!r}: {name!r} links outside the allowed model roots; "
                             "copy the file into the folder instead of linking it")
        try:
            st = os.stat(p)
        except OSError as exc:
            raise ValueError(f"{field}: {value[:120]!r}: {name!r} cannot be read ({exc.strerror})") from None
        if st.st_nlink > 1:
            shared.append((name, st))
    devices = set()
    for r in protected:
        with contextlib.suppress(OSError):
            devices.add(os.stat(r).st_dev)
    if any(st.st_dev in devices for _, st in shared):  # a hard link needs the same device
        index = mr.hard_links(protected)
        for name, st in shared:
            rel = index.get((st.st_dev, st.st_ino))
            if rel is not None:
                raise ValueError(f"{field}: {value[:120]!r}: {name!r} is a hard link to a file of the "
                                 f"artifact store; write {_job_of(rel)} (artifacts are named by job, "
                                 "which checks who may use them)")
    bad = mr.shard_names(files)
    if bad:
        raise ValueError(f"{field}: {value[:120]!r}: its weight index names the shard {bad[0][:80]!r}, "
                         "which is not a file of the folder; shards must sit beside the index")
    return files


def _model_ref(settings: Any, field: str, value: str, local: bool, hash_models: bool) -> Ref:
    try:
        path = _model_path(settings, value, local)
    except ValueError as exc:
        raise ValueError(str(exc).replace("model:", f"{field}:", 1)) from None
    if mr.is_hub_id(path):
        _check_hub_cached(settings, field, value)
        _check_remote_code(settings, field, value, _hub_config(value))
        return Ref(field=field, given=value, target="model", form="hub", path=path)
    folder = Path(path)
    _check_remote_code(settings, field, value, folder / "config.json")
    zoo = Path(settings.zoo_dir).expanduser().resolve()
    try:
        files = _checked_reads(settings, field, value, mr.read_files(folder, "model"), local)
    except OSError as exc:
        raise ValueError(f"{field}: {value[:80]!r}: not a usable folder ({exc.strerror})") from None
    form: RefForm = "zoo" if folder.parent == zoo else "local"
    if form == "local":  # the operator's zoo is trusted; a user's folder is checked
        _check_config(field, value, folder, files)
    sha = mr.folder_revision(folder) if hash_models else None
    return Ref(field=field, given=value, target="model", form=form,
               path=str(folder), sha256=sha, files=mr.manifest(files) if hash_models else None,
               label=folder.name, local=str(folder))


# Sane bounds on what a user's config.json asks the loader to build (the largest released models
# are well inside them); a config past one, or one that builds another model than its weights
# hold, is refused at submit: the loader would allocate what the config says (the attack
# measured: num_hidden_layers 1,000,000 grew a worker ~10 MB/s until it was killed).
CONFIG_BOUNDS = {
    "num_hidden_layers": 512, "hidden_size": 65_536, "intermediate_size": 1_048_576,
    "vocab_size": 4_194_304, "num_attention_heads": 1024, "num_key_value_heads": 1024,
    "max_position_embeddings": 16_777_216, "head_dim": 4096, "num_experts": 4096,
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_config(field: str, value: str, folder: Path, files: dict[str, Path]) -> None:
    """ValueError naming the field unless config.json's sizes are within CONFIG_BOUNDS and agree
    with the weights' safetensors headers (layers: the highest `layers.<i>.` index + 1; hidden
    size and vocabulary: the input embedding's shape), every header fully valid (app.services.
    compat.safetensors_header: size, tensor count, offsets against the file size)."""
    from app.services.compat import safetensors_header, shapes

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # unreadable: the loader says why
    if not isinstance(cfg, dict):
        return
    for part in (cfg, cfg.get("text_config")):
        if not isinstance(part, dict):
            continue
        for key, bound in CONFIG_BOUNDS.items():
            v = part.get(key)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= bound:
                raise ValueError(f"{field}: {value[:120]!r}: config.json {key} is {str(v)[:20]}; "
                                 f"accepted: 0 .. {bound:,}")
    weights = [n for n in files if n.endswith(".safetensors")]
    if not weights:
        return  # .bin weights: no header to compare with
    for name in weights:  # every header fully valid before anything counts on it
        try:
            safetensors_header(files[name])
        except ValueError as exc:
            raise ValueError(f"{field}: {value[:120]!r}: {name[:80]!r} {exc}") from None
    got = shapes(folder)
    if not got or any(isinstance(cfg.get(k), dict) for k in ("text_config", "vision_config")):
        return  # a multimodal config: its towers' layers are not the text model's
    text = cfg
    layers = {int(m.group(1)) for name in got if (m := _LAYER.search(name))}
    want = text.get("num_hidden_layers")
    if layers and isinstance(want, int) and want != max(layers) + 1:
        raise ValueError(f"{field}: {value[:120]!r}: config.json asks for {want:,} layers and the "
                         f"weights hold {max(layers) + 1}; the config must describe the weights")
    emb = next((s for n, s in got.items() if n.endswith("embed_tokens.weight") and len(s) == 2), None)
    if emb is not None:
        for key, dim in (("vocab_size", 0), ("hidden_size", 1)):
            v = text.get(key)
            if isinstance(v, int) and v != emb[dim]:
                raise ValueError(f"{field}: {value[:120]!r}: config.json {key} is {v:,} and the "
                                 f"weights' embedding has {emb[dim]:,}; the config must describe "
                                 "the weights")


def _model_path(settings: Any, value: str, local: bool) -> str:
    """A zoo name, an allowed folder (any folder when `local`) or a hub id -> path or hub id."""
    if local:
        try:
            raw = Path(value).expanduser()
            if raw.is_dir():
                if not (raw / "config.json").is_file():
                    raise ValueError(f"model: {value!r} is not a Hugging Face model directory (no config.json)")
                return str(raw.resolve())
        except OSError:
            pass
    try:
        return mr.resolve_model(value, settings)
    except OSError as exc:  # e.g. a 300-character name: "File name too long"
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise ValueError(f"model: {shown!r} is not a usable model reference "
                         f"({exc.strerror or type(exc).__name__})") from None


def _hub_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - any hub-cache error: nothing known here
        return None
    return Path(found) if isinstance(found, str) else None


def _check_hub_cached(settings: Any, field: str, repo_id: str) -> None:
    """Offline (HF_HUB_OFFLINE=1), a hub id is usable only if its files are in the local cache."""
    if settings.offline and _hub_config(repo_id) is None:
        raise ValueError(f"{field}: hub model {repo_id!r} is not in the local cache and this server is "
                         "offline (HF_HUB_OFFLINE=1); give a zoo name, a local folder or job:N")


def _check_remote_code(settings: Any, field: str, value: str, config: Path | None) -> None:
    """A model whose config.json names its own code (`auto_map`) runs that code when loaded:
    refused here, at submit, unless the operator opted in with TRUST_REMOTE_CODE=1."""
    if settings.trust_remote_code or config is None:
        return
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # unreadable: the loader says why
    if isinstance(cfg, dict) and cfg.get("auto_map"):
        raise ValueError(f"{field}: {value!r} needs its own code to load (config.json has auto_map) "
                         "and this server does not run model code; the operator can allow it with "
                         "TRUST_REMOTE_CODE=1")


def _file_ref(settings: Any, field: str, value: str, target: RefTarget, local: bool) -> Ref:
    """A fisher / mask / gradient safetensors file named by path."""
    from app.services.compat import check_safetensors

    path = Path(value).expanduser()
    if not local and not path.is_absolute():
        raise ValueError(f"{field}: {value!r}: give an absolute path, or job:<id> of a {field} job")
    try:
        resolved = path.resolve()
        if not local and not mr.inside_roots(resolved, list(settings.model_roots)):
            raise ValueError(f"{field}: {value!r} is outside the allowed model roots; "
                             f"use job:<id> of a {field} job")
        if resolved.is_dir() and (resolved / f"{target}.safetensors").is_file():
            inner = resolved / f"{target}.safetensors"  # the file inside: checked as it is read
            _checked_reads(settings, field, value, {inner.name: inner}, local)
            resolved = Path(os.path.realpath(inner))
        if not resolved.is_file():
            raise ValueError(f"{field}: {value!r}: file does not exist")
        _checked_reads(settings, field, value, {resolved.name: resolved}, local)
        check_safetensors(resolved)
        sha = mr.file_sha256(resolved)
    except OSError as exc:
        raise ValueError(f"{field}: {value[:80]!r}: not a usable path ({exc.strerror})") from None
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith(f"{field}: ") else f"{field}: {value!r} {msg}") from None
    return Ref(field=field, given=value, target=target, form="local", path=str(resolved),
               sha256=sha, local=str(resolved))
