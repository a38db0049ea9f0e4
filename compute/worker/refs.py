"""The worker's side of references: the Refs resolved at submit (jobs.refs, app.services.refs)
made readable here. Nothing is resolved again: an artifact is fetched through the artifact store
(`open_store(settings).fetch(key, sha256)`, which re-verifies its sha256; an object-store
backend returns a verified local copy), a zoo or local model folder and a local file are
re-hashed against the sha256 recorded at submit (cached per file by real path, inode, size,
mtime and ctime), and a hub id is passed on as it is. A folder resolved with a manifest
(`Ref.files`: every file the job reads, name -> sha256) is read only if it holds exactly those
files, none of them (links followed) in the artifact store or its cache, each with the bytes it
had at submit: a link swapped after submit, a file added, or a hard link put in place of a file
fails the job here, before anything is loaded. Runners get {field: Ref} with `local` set (compute/jobs/runners.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compute.contract.kinds import Ref
from compute.contract.modelref import (
    file_sha256,
    folder_revision,
    manifest,
    protected_hit,
    read_files,
    run_dir_revision,
)


class StaleJob(ValueError):
    """A job row without resolved references (queued before they were stored with the job)."""


def fetch_refs(settings: Any, job_id: int, stored: dict[str, Any] | None) -> dict[str, Ref]:
    """{field: Ref with `local` set} from a job's stored refs; ValueError naming the field when
    a file is missing or no longer matches the sha256 it had at submit."""
    from storage.artifacts import ArtifactError, open_store, protected_roots

    if stored is None:
        raise StaleJob(f"refs: job {job_id} has no resolved references (it was queued before "
                       "references were resolved at submit); re-run it")
    store = None
    out: dict[str, Ref] = {}
    for field, data in stored.items():
        ref = Ref.model_validate(data)
        if ref.form == "artifact":
            store = store or open_store(settings)
            try:
                local = str(store.fetch(ref.path, str(ref.sha256)))
            except ArtifactError:
                raise ValueError(f"{field}: the {ref.target} of job {ref.job_id} is missing from the "
                                 f"artifact store or changed since submit (sha256); re-run job "
                                 f"{ref.job_id}") from None
        elif ref.form in ("zoo", "local") and ref.files is not None:
            _verify_files(field, ref, protected_roots(settings))
            local = ref.path
        elif ref.form in ("zoo", "local") and ref.sha256 is not None:
            path = Path(ref.path)
            try:
                if ref.target == "run_dir":
                    actual = run_dir_revision(path)
                else:
                    actual = folder_revision(path) if path.is_dir() else file_sha256(path)
            except OSError:
                actual = None
            if actual != ref.sha256:
                raise ValueError(f"{field}: {ref.given} is missing or changed since the job was "
                                 "submitted (its sha256 differs); submit it again")
            local = ref.path
        else:  # a hub id, or a direct CLI run's folder (not hashed)
            local = ref.path
        out[field] = ref.model_copy(update={"local": local})
    return out


def _verify_files(field: str, ref: Ref, protected: list[Path]) -> None:
    """ValueError naming the field unless ref.path holds exactly the files of ref.files, none of
    them really in the artifact store, each with its recorded sha256."""
    changed = f"{field}: {ref.given} changed since the job was submitted"
    try:
        files = read_files(Path(ref.path), ref.target)
        if sorted(files) != sorted(ref.files or {}):
            extra = sorted(set(files) - set(ref.files or {}))
            gone = sorted(set(ref.files or {}) - set(files))
            what = f"new file {extra[0]!r}" if extra else f"{gone[0]!r} is gone"
            raise ValueError(f"{changed} ({what}); submit it again")
        for name, p in files.items():
            if protected_hit(p, protected) is not None:
                raise ValueError(f"{changed}: {name!r} now links into the artifact store; refused")
        actual = manifest(files)
    except OSError as exc:
        raise ValueError(f"{changed} (unreadable: {exc.strerror}); submit it again") from None
    for name, sha in (ref.files or {}).items():
        if actual[name] != sha:
            raise ValueError(f"{changed} ({name!r} holds other bytes: its sha256 differs); submit it again")


Snapshot = dict[str, tuple[int, int, int]]  # "field:name" -> (device, inode, ctime_ns), lstat


def _entries(ref: Ref) -> dict[str, Path]:
    root = Path(ref.path)
    entries = {".": root, **read_files(root, ref.target)}
    return entries | {p.parent.name: p.parent for p in list(entries.values())[1:] if p.parent != root}


def snapshot(refs: dict[str, Ref]) -> Snapshot:
    """What every checked folder entry *is* right after fetch_refs verified it (lstat: a link
    as a link): the folder, each checkpoint folder and each file the job reads. `unchanged`
    compares it after the job, so a link swapped to another file for the job's run and swapped
    back (a new link: a new inode and ctime) fails the job instead of storing its result."""
    out: Snapshot = {}
    for field, ref in refs.items():
        if ref.form in ("zoo", "local") and ref.files is not None:
            for name, p in _entries(ref).items():
                st = p.lstat()
                out[f"{field}:{name}"] = (st.st_dev, st.st_ino, st.st_ctime_ns)
    return out


def unchanged(refs: dict[str, Ref], before: Snapshot) -> None:
    """ValueError naming the field when an entry of `before` is not what it was (see snapshot)."""
    for key, was in before.items():
        field, _, name = key.partition(":")
        p = _entries_path(refs[field], name)
        try:
            st = p.lstat()
            now = (st.st_dev, st.st_ino, st.st_ctime_ns)
        except OSError:
            now = None
        if now != was:
            raise ValueError(f"{field}: {refs[field].given} changed while the job ran ({name!r} was "
                             "replaced or changed); its result is not stored; submit it again")


def _entries_path(ref: Ref, name: str) -> Path:
    root = Path(ref.path)
    return root if name == "." else root / name
