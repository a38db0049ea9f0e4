"""Reference names without a database: zoo names, local HF directories inside the allowed roots,
hub ids, the `job:N` syntax, content hashes of model folders and files, and which spec fields are
references.

Pure (the contract imports pydantic and itself only; this module uses the standard library).
The one resolver of every reference form, `job:N` and owners included, is app.services.refs: it
runs once, at validation, and the worker receives its typed `Ref`s (compute.contract.kinds).
`resolve_model` here resolves a *name* (zoo, allowed folder, hub id) for library callers that
run the engine without refs (tests, notebooks); it refuses `job:N`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

ZOO_NAMES = ("arith-base", "arith-teacher", "arith-deep-base", "arith-deep-teacher")
# Real pretrained models converted into the zoo by `fisherlens zoo add NAME` (compute.zoo).
REAL_MODEL_NAMES = ("smollm2-135m", "gemma3-270m")

# org/name on the Hugging Face hub (no path tricks: no leading dot, no '..', exactly one '/').
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

# Files whose content defines the model's behaviour (hashed by model_revision).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_EXTRA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")

# (real path, device, inode, size, mtime_ns, ctime_ns) -> sha256. The real path and inode, not
# the name: a link swapped to another file of the same size and (settable) mtime must miss;
# ctime cannot be set by a user, so a hit is the same bytes.
_file_digests: dict[tuple[str, int, int, int, int, int], str] = {}

JOB_REF = re.compile(r"^job:(\d{1,12})$")
MODEL_FIELDS = ("model", "teacher", "base", "tuned")
# Which fields are references, to what, and which job kinds provide each target (a `job:N`):
# the kinds' `refs` and `outputs` (compute/jobs/<kind>.py, read through compute.jobs.registry).


def job_ref_id(ref: Any) -> int | None:
    """N for 'job:N', else None."""
    m = JOB_REF.match(ref.strip()) if isinstance(ref, str) else None
    return int(m.group(1)) if m else None


def trained_model_label(job_id: int, spec: dict[str, Any]) -> str:
    """'#6 train arith-base grpo masked': how a trained model is listed in the UI."""
    masked = " masked" if spec.get("mask") or spec.get("mask_select") else ""
    base = spec.get("model") or "?"
    if job_ref_id(base) is not None:
        base = f"#{job_ref_id(base)}"
    return f"#{job_id} train {base} {spec.get('algo', 'grpo')}{masked}"


def _settings(settings: Any | None) -> Any:
    if settings is None:
        from compute.contract.settings import get_settings

        settings = get_settings()
    return settings


def looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~", "\\")) or ref in (".", "..") or "\\" in ref


def inside_roots(path: Path, roots: list[Path]) -> bool:
    """Whether resolved `path` is one of `roots` (resolved here) or below one."""
    return any(path.is_relative_to(Path(r).expanduser().resolve()) for r in roots)


def _local_dir(ref: str, roots: list[Path]) -> str:
    raw = Path(ref).expanduser()
    # Messages never list the roots: they are server paths (the operator knows them).
    if ".." in raw.parts:
        raise ValueError(f"model: {ref!r} contains '..'; give a path inside the allowed model roots")
    resolved = raw.resolve()  # follows symlinks, so a link inside a root to outside is rejected
    if not inside_roots(resolved, roots):
        raise ValueError(
            f"model: local directory {ref!r} is outside the allowed model roots; "
            "the operator can add folders with ALLOWED_MODEL_ROOTS=/a:/b"
        )
    if not resolved.is_dir():
        raise ValueError(f"model: local directory {ref!r} does not exist")
    if not (resolved / "config.json").is_file():
        raise ValueError(f"model: {ref!r} is not a Hugging Face model directory (no config.json)")
    return str(resolved)


def resolve_model(ref: str, settings: Any | None = None) -> str:
    """Zoo name -> its folder; local dir (inside settings.model_roots) -> resolved path;
    hub id ``org/name`` -> unchanged; ``job:N`` (a succeeded train job) -> its verified saved
    model folder in the artifact store. Anything else: ValueError "model: ..."."""
    settings = _settings(settings)
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(
            "model: empty model reference; give a zoo name, a local directory or org/name"
        )
    ref = ref.strip()
    if job_ref_id(ref) is not None:
        raise ValueError(
            f"model: {ref!r} is a job reference; job:N is resolved (with its owner) by "
            "app.services.refs at validation, and runners receive the resolved Ref"
        )
    try:
        return _resolve_name_or_path(ref, settings)
    except OSError as exc:  # e.g. a 300-character name: "File name too long"
        shown = ref if len(ref) <= 80 else ref[:77] + "..."
        raise ValueError(
            f"model: {shown!r} is not a usable model reference ({exc.strerror or type(exc).__name__})"
        ) from None


def _resolve_name_or_path(ref: str, settings: Any) -> str:
    zoo_dir = Path(settings.zoo_dir).expanduser().resolve()
    if ref in ZOO_NAMES or (
        re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", ref)
        and (zoo_dir / ref / "config.json").is_file()
    ):
        path = zoo_dir / ref
        if not (path / "config.json").is_file():
            raise ValueError(f"model: zoo model {ref!r} is not built; run `fisherlens zoo build`")
        return str(path)
    if ref in REAL_MODEL_NAMES:
        path = zoo_dir / ref
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {ref!r} is not added yet; run `fisherlens zoo add {ref}`")
        return str(path)
    roots = list(settings.model_roots)
    if looks_like_path(ref) or Path(ref).expanduser().exists():
        return _local_dir(ref, roots)
    if _HUB_ID.match(ref) and ".." not in ref:
        return ref
    raise ValueError(
        f"model: unknown model {ref!r}; accepted: a zoo name ({', '.join(ZOO_NAMES)}), "
        "a local HF directory inside the allowed model roots, a hub id org/name, or job:N "
        "(a succeeded train job)"
    )


def is_hub_id(resolved: str) -> bool:
    return not Path(resolved).is_absolute() and bool(_HUB_ID.match(resolved))


def file_sha256(path: Path) -> str:
    """sha256 hex of a file (links followed), cached by what it is: its real path, inode, size,
    mtime and ctime (never by the name alone, which a link can point elsewhere)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _file_digests.get(key)
    if digest is None:
        h = hashlib.sha256()
        with open(real, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = h.hexdigest()
        _file_digests[key] = digest
    return digest


def model_revision(ref: str, settings: Any | None = None) -> str:
    """Content hash (sha256 hex) of a local model's config, tokenizer and weight files; the hub
    id itself for hub models. Per-file digests are cached by (path, mtime, size)."""
    resolved = resolve_model(ref, settings)
    if is_hub_id(resolved):
        return resolved
    return folder_revision(Path(resolved))


def folder_revision(folder: Path) -> str:
    """sha256 hex over (name, sha256) of a model folder's config, tokenizer and weight files:
    the revision model_revision reports (and the zoo manifest records)."""
    files = sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and (p.name in _EXTRA_FILES or p.name.endswith(_WEIGHT_SUFFIXES))
    )
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()


def name_ref(field: str, value: str, target: str, settings: Any | None = None) -> Any:
    """A `Ref` (compute.contract.kinds) for library callers that run the engine without refs
    (tests, notebooks, benchmarks): a model by name (zoo, a folder inside the allowed roots, a
    hub id) or a file by path (a folder holding `<target>.safetensors` names that file). No
    database and no owners: `job:N` is refused; the product resolves every reference once with
    app.services.refs and hands runners its Refs."""
    from compute.contract.kinds import Ref

    value = str(value).strip()
    if target == "model":
        try:
            found = resolve_model(value, _settings(settings))
        except ValueError as exc:
            raise ValueError(str(exc).replace("model:", f"{field}:", 1)) from None
        zoo = Path(_settings(settings).zoo_dir).expanduser().resolve()
        form = "hub" if is_hub_id(found) else "zoo" if Path(found).parent == zoo else "local"
        return Ref.model_validate({"field": field, "given": value, "target": "model",
                                   "form": form, "path": found})
    if job_ref_id(value) is not None:
        raise ValueError(f"{field}: {value!r} is a job reference; job:N is resolved by "
                         "app.services.refs (pass the resolved refs to the runner)")
    path = Path(value).expanduser()
    if target == "run_dir":  # a folder of checkpoint-<step>
        if not path.is_dir():
            raise ValueError(f"{field}: folder not found: {value}")
        return Ref.model_validate({"field": field, "given": value, "target": target,
                                   "form": "local", "path": str(path.resolve())})
    if path.is_dir() and (path / f"{target}.safetensors").is_file():
        path = path / f"{target}.safetensors"
    if not path.is_file():
        raise ValueError(f"{field}: file not found: {value}")
    return Ref.model_validate({"field": field, "given": value, "target": target, "form": "local",
                               "path": str(path.resolve())})


_CHECKPOINT = re.compile(r"checkpoint-\d+")


def checkpoints(folder: Path) -> list[Path]:
    """The checkpoint-<step> subfolders of a run folder (TRL / HF Trainer / fisherlens train
    --save-steps), in step order."""
    found = [p for p in folder.iterdir() if _CHECKPOINT.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def run_dir_revision(folder: Path) -> str:
    """sha256 hex over (checkpoint name, folder_revision) of every checkpoint of a run folder: what
    the resolver records for a run_dir reference and the worker re-verifies."""
    h = hashlib.sha256()
    for c in checkpoints(folder):
        h.update(f"{c.name}\0{folder_revision(c)}\n".encode())
    return h.hexdigest()



# -- what a job reads: every file, links followed -------------------------------------------------
def read_files(folder: Path, target: str) -> dict[str, Path]:
    """relative name -> path of every file a job reads from a model folder (`target` "model":
    each top-level entry that is not a folder: config, tokenizer files, weights, shard index,
    whatever the loaders open by name) or a run folder ("run_dir": those of each
    checkpoint-<step> folder, as 'checkpoint-N/<name>'). Links are listed as they are (the
    caller resolves them); a broken link is listed too (it resolves nowhere allowed)."""
    folders = [(c.name + "/", c) for c in checkpoints(folder)] if target == "run_dir" else [("", folder)]
    out: dict[str, Path] = {}
    for prefix, f in folders:
        for p in sorted(f.iterdir()):
            if not p.is_dir():
                out[prefix + p.name] = p
    return out


def manifest(files: dict[str, Path]) -> dict[str, str]:
    """relative name -> sha256 of the bytes each file (links followed) holds: what the worker
    re-verifies before it reads a folder (compute.worker.refs)."""
    return {name: file_sha256(p) for name, p in files.items()}


def protected_hit(path: Path, protected: list[Path]) -> str | None:
    """The path relative to the protected root (the artifact store, its cache) that `path`
    really is, links followed; None when it is none of theirs."""
    real = Path(os.path.realpath(path))
    for root in protected:
        if real.is_relative_to(root):
            return real.relative_to(root).as_posix()
    return None


def hard_links(protected: list[Path]) -> dict[tuple[int, int], str]:
    """(device, inode) -> path relative to its root, of every file under the protected roots
    that has more than one name (st_nlink > 1): what a hard link made elsewhere into the store
    shares. Walked only when a candidate file itself has st_nlink > 1."""
    out: dict[tuple[int, int], str] = {}
    for root in protected:
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                p = os.path.join(dirpath, name)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if st.st_nlink > 1:
                    out[(st.st_dev, st.st_ino)] = Path(p).relative_to(root).as_posix()
    return out


def shard_names(files: dict[str, Path]) -> list[str]:
    """The shard file names the weight indexes (`*.index.json`) of a model folder name that are
    not plain files of the folder (a name like '../x' or '/abs/x' makes the loader read outside
    it); [] when every index names only files of the folder."""
    bad: list[str] = []
    for name, p in files.items():
        if not name.endswith(".index.json"):
            continue
        try:
            index = json.loads(p.read_text())
        except (OSError, ValueError):
            continue  # unreadable: the loader says why
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            continue
        prefix = name.rsplit("/", 1)[0] + "/" if "/" in name else ""  # a checkpoint's index
        for shard in {str(v) for v in weight_map.values()}:
            if "/" in shard or "\\" in shard or shard in (".", "..") or prefix + shard not in files:
                bad.append(shard)
    return sorted(bad)
