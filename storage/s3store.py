"""The artifact store in S3-compatible object storage (AWS S3, MinIO, ...): ARTIFACT_URL=s3://BUCKET/PREFIX.

Same interface and same relative paths as the folder backend (storage.artifacts.ArtifactStore):
a file artifact is the object PREFIX/<job_id>/<name>; a folder artifact (a trained model) is the
objects PREFIX/<job_id>/<kind>/<relative path>, plus the manifest PREFIX/<job_id>/<kind>.dir.json
listing them with their sha256 (uploaded last: a folder without its manifest does not exist).

Publishing is upload, then verify, then the caller records the sha256 in the database:
- uploads are boto3 managed transfers (multipart past MULTIPART_THRESHOLD, parts retried);
  each object carries its sha256 as user metadata, and is checked after the upload by a HEAD
  (size and sha256 as stored);
- the database row is written only after every object of the result is uploaded and verified
  (storage.results.save_result), so a failed upload publishes nothing; what an interrupted
  attempt did upload is unreferenced, removed when possible, and overwritten by the retry;
- inside `upload_retries(...)` (a worker publishing a job's result) a store that cannot be
  reached is retried with back-off instead of failing the job: the computed result is kept.

Reads go through the machine's ArtifactCache (storage.artifact_cache): downloaded into a staging
folder, checked against the sha256 the database recorded, then installed; a mismatch is an
ArtifactError ("corrupt ... sha256"), never a silently different tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import Any

from storage.artifact_cache import ArtifactCache, release_pins, unpin
from storage.artifact_common import (
    ArtifactError,
    ArtifactInfo,
    ArtifactMissing,
    ArtifactStoreUnavailable,
    check_kind,
    retry_policy,
    sha256_dir,
    sha256_file,
    tensors_bytes,
    uploaded_hook,
)

log = logging.getLogger("fisherlens.artifacts")

MULTIPART_THRESHOLD = 64 * 2**20
MULTIPART_CHUNK = 16 * 2**20
DIR_MANIFEST = ".dir.json"


def parse_url(url: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix")."""
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


_PERMANENT = ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")


def _transient(exc: BaseException) -> bool:
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, S3UploadFailedError):  # boto3 wraps the ClientError of an upload
        return not any(code in str(exc) for code in _PERMANENT)
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = exc.response.get("Error", {}).get("Code", "")
        return int(status) >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError")
    return isinstance(exc, BotoCoreError)


def _code(exc: BaseException) -> str:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return next((code for code in _PERMANENT if code in str(exc)), "")


class S3ArtifactStore:
    remote = True

    def __init__(self, url: str, cache: ArtifactCache, client: Any):
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        self.cache = cache
        self.client = client
        from boto3.s3.transfer import TransferConfig

        self.transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK
        )

    def __repr__(self) -> str:
        return f"S3ArtifactStore({self.url})"

    def describe(self) -> str:
        return self.url

    # -- keys -------------------------------------------------------------------------------
    def key(self, rel_path: str) -> str:
        """The object key of a stored relative path; refuses paths escaping the prefix."""
        p = PurePosixPath(str(rel_path))
        if p.is_absolute() or ".." in p.parts or not p.parts or "\\" in str(rel_path):
            raise ArtifactError(f"artifact path {rel_path!r} is outside the artifact store {self.url}")
        return f"{self.prefix}/{p.as_posix()}" if self.prefix else p.as_posix()

    def _job_prefix(self, job_id: int) -> str:
        return self.key(str(int(job_id))) + "/"

    # -- errors and retries -----------------------------------------------------------------
    def _unavailable(self, exc: BaseException, doing: str) -> ArtifactStoreUnavailable:
        code = _code(exc)
        hint = {
            "NoSuchBucket": f"bucket {self.bucket!r} does not exist; create it (e.g. `mc mb`)",
            "AccessDenied": "access denied; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY",
            "InvalidAccessKeyId": "unknown access key; check AWS_ACCESS_KEY_ID",
            "SignatureDoesNotMatch": "wrong secret key; check AWS_SECRET_ACCESS_KEY",
        }.get(code, "")
        detail = f"{type(exc).__name__}: {exc}"
        return ArtifactStoreUnavailable(
            f"artifact store {self.url}: {doing} failed ({hint or detail})",
            transient=_transient(exc),
        )

    def _call(self, doing: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs); store errors become ArtifactStoreUnavailable. Inside
        upload_retries(...) transient ones are retried (backing off) until its deadline."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        policy = retry_policy()
        deadline = time.monotonic() + (policy[0] if policy else 0.0)
        delay = 1.0
        while True:
            try:
                return fn(*args, **kwargs)
            except (BotoCoreError, ClientError, Boto3Error) as exc:
                if isinstance(exc, ClientError) and _code(exc) in ("404", "NoSuchKey", "NotFound"):
                    raise
                err = self._unavailable(exc, doing)
                if policy is None or not err.transient or time.monotonic() + delay > deadline:
                    if policy is not None and err.transient:
                        raise ArtifactStoreUnavailable(
                            f"{err} for {policy[0]:.0f} s (ARTIFACT_UPLOAD_RETRY_S); nothing of "
                            "this job was published", transient=True) from exc
                    raise err from exc
                if policy[1] is not None:
                    policy[1](f"artifact store unreachable while {doing}; retrying in "
                              f"{delay:.0f} s ({type(exc).__name__})")
                log.warning("%s; retrying in %.0f s", err, delay)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    # -- writing ----------------------------------------------------------------------------
    def _put_file(self, key: str, src: Path | bytes, sha256: str, size: int) -> None:
        """Upload (managed transfer: multipart past the threshold) and verify by HEAD."""

        def upload() -> None:
            extra = {"Metadata": {"sha256": sha256}}
            if isinstance(src, bytes):
                self.client.upload_fileobj(io.BytesIO(src), self.bucket, key, ExtraArgs=extra,
                                           Config=self.transfer)
            else:
                self.client.upload_file(str(src), self.bucket, key, ExtraArgs=extra,
                                        Config=self.transfer)
            head = self.client.head_object(Bucket=self.bucket, Key=key)
            got = (int(head["ContentLength"]), (head.get("Metadata") or {}).get("sha256"))
            if got != (size, sha256):
                raise ArtifactError(
                    f"artifact store {self.url}: object {key} reads back as {got[0]} bytes, "
                    f"sha256 {str(got[1])[:12]}... after the upload of {size} bytes, "
                    f"sha256 {sha256[:12]}...; not published"
                )

        self._call(f"uploading {key}", upload)
        hook = uploaded_hook()
        if hook is not None:
            hook(key)

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def _list(self, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            out += page.get("Contents") or []
        return out

    def _seed(self, sha256: str, name: str, src: Path | bytes, move: bool) -> None:
        """Put what was just uploaded into the local cache (the next reader here needs no
        download). Best effort: a failure only costs a download later."""
        try:
            staged = self.cache.stage()
            try:
                if isinstance(src, bytes):
                    (staged / name).write_bytes(src)
                elif move:
                    shutil.move(str(src), str(staged / name))
                elif src.is_dir():
                    shutil.copytree(src, staged / name)
                else:
                    shutil.copyfile(src, staged / name)
            except BaseException:
                self.cache.discard(staged)
                raise
            self.cache.install(sha256, name, staged)
        except OSError:
            log.exception("could not put %s into the artifact cache", name)

    def save_tensors(self, job_id: int, kind: str, tensors: dict[str, Any],
                     metadata: dict[str, str] | None = None) -> ArtifactInfo:
        check_kind(kind)
        return self.save_bytes(job_id, f"{kind}.safetensors", tensors_bytes(tensors, metadata),
                               kind=kind)

    def save_bytes(self, job_id: int, filename: str, data: bytes,
                   kind: str | None = None) -> ArtifactInfo:
        rel = f"{int(job_id)}/{filename}"
        digest = hashlib.sha256(data).hexdigest()
        self._put_file(self.key(rel), data, digest, len(data))
        self._seed(digest, PurePosixPath(filename).name, data, move=False)
        return ArtifactInfo(kind or filename, rel, digest, len(data))

    def save_folder(self, job_id: int, kind: str, src: Path | str) -> ArtifactInfo:
        """Upload folder `src` as objects under <job_id>/<kind>/ and its manifest (last); a plain
        file as <job_id>/<kind><suffix>. `src` is moved into the local cache afterwards."""
        check_kind(kind)
        src = Path(src)
        if not src.exists():
            raise ArtifactError(f"files[{kind!r}]: {src} does not exist")
        if src.is_file():
            rel = f"{int(job_id)}/{kind}{src.suffix}"
            digest, size = sha256_file(src), src.stat().st_size
            self._put_file(self.key(rel), src, digest, size)
            self._seed(digest, PurePosixPath(rel).name, src, move=False)
            return ArtifactInfo(kind, rel, digest, size)
        rel = f"{int(job_id)}/{kind}"
        files: list[dict[str, Any]] = [
            {"path": f.relative_to(src).as_posix(), "sha256": sha256_file(f), "bytes": f.stat().st_size}
            for f in sorted(p for p in src.rglob("*") if p.is_file())
        ]
        digest, size = sha256_dir(src)
        folder_key = self.key(rel) + "/"
        done: list[str] = []
        try:
            for f in files:
                key = folder_key + f["path"]
                self._put_file(key, src / f["path"], f["sha256"], f["bytes"])
                done.append(key)
            manifest = json.dumps({"sha256": digest, "bytes": size, "files": files}).encode()
            self._put_file(self.key(rel + DIR_MANIFEST), manifest,
                           hashlib.sha256(manifest).hexdigest(), len(manifest))
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: the store may be down
                self._delete_keys(done)
            raise
        # objects of an earlier, interrupted attempt that this folder does not have
        with contextlib.suppress(Exception):
            stray = [o["Key"] for o in self._list(folder_key) if o["Key"] not in set(done)]
            self._delete_keys(stray)
        self._seed(digest, kind, src, move=True)
        return ArtifactInfo(kind, rel, digest, size, is_dir=True)

    def remove_job(self, job_id: int) -> None:
        keys = [o["Key"] for o in self._call("listing", self._list, self._job_prefix(job_id))]
        self._call("deleting", self._delete_keys, keys)

    # -- reading ----------------------------------------------------------------------------
    def _head(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return dict(self._call(f"reading {key}", self.client.head_object,
                                   Bucket=self.bucket, Key=key))
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def _get_bytes(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            obj = self._call(f"reading {key}", self.client.get_object, Bucket=self.bucket, Key=key)
            return bytes(self._call(f"reading {key}", obj["Body"].read))
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def exists(self, rel_path: str) -> bool:
        key = self.key(rel_path)
        return self._head(key) is not None or self._head(key + DIR_MANIFEST) is not None

    def read_bytes(self, rel_path: str) -> bytes | None:
        """A small object's bytes (unverified: figure JSON), None when there is none."""
        return self._get_bytes(self.key(rel_path))

    def _corrupt(self, rel_path: str, actual: str, sha256: str) -> ArtifactError:
        return ArtifactError(
            f"artifact {rel_path!r} is corrupt: sha256 {actual[:12]}... of the object in "
            f"{self.url} does not match the recorded {sha256[:12]}...; re-run the job to "
            "regenerate it"
        )

    def fetch(self, rel_path: str, sha256: str) -> Path:
        """A verified local copy (file or folder) in this machine's cache, downloaded on a miss.
        ArtifactError when it is missing or does not match `sha256`; ArtifactStoreUnavailable
        when the store cannot be reached."""
        key = self.key(rel_path)
        name = PurePosixPath(key).name
        cached = self.cache.get(sha256, name)
        if cached is not None:
            return cached
        staged = self.cache.stage()
        try:
            target = staged / name
            if self._download_file(key, target):
                actual = sha256_file(target)
            else:
                actual = self._download_folder(rel_path, key, target)
            if actual != sha256:
                raise self._corrupt(rel_path, actual, sha256)
        except BaseException:
            self.cache.discard(staged)
            raise
        return self.cache.install(sha256, name, staged)

    def _download_file(self, key: str, target: Path) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._call(f"downloading {key}", self.client.download_file, self.bucket, key,
                       str(target), Config=self.transfer)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def _download_folder(self, rel_path: str, key: str, target: Path) -> str:
        raw = self._get_bytes(key + DIR_MANIFEST)
        if raw is None:
            raise ArtifactMissing(f"artifact {rel_path!r} is missing from the artifact store {self.url}")
        try:
            files = json.loads(raw)["files"]
        except (ValueError, KeyError, TypeError):
            raise ArtifactError(f"artifact {rel_path!r}: its folder manifest in {self.url} is "
                                "unreadable (corrupt); re-run the job to regenerate it") from None
        target.mkdir()
        for f in files:
            rel = PurePosixPath(str(f["path"]))
            if rel.is_absolute() or ".." in rel.parts:
                raise ArtifactError(f"artifact {rel_path!r}: its manifest names {rel} (outside)")
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not self._download_file(f"{key}/{rel.as_posix()}", dest):
                raise ArtifactMissing(f"artifact {rel_path!r}: file {rel} is missing from the "
                                    f"artifact store {self.url}; re-run the job")
        return sha256_dir(target)[0]

    def load_tensors(self, rel_path: str, sha256: str | None) -> dict[str, Any]:
        from safetensors.torch import load

        if sha256 is None:
            data = self.read_bytes(rel_path)
            if data is None:
                raise ArtifactMissing(f"artifact {rel_path!r} is missing from the artifact store {self.url}")
            return load(data)
        return load(self.fetch(rel_path, sha256).read_bytes())

    def download_url(self, rel_path: str, sha256: str, filename: str, expires_s: int) -> str | None:
        """A presigned GET URL of a single-file artifact (None for folders), after checking that
        the object carries the recorded sha256."""
        key = self.key(rel_path)
        head = self._head(key)
        if head is None:
            return None
        if (head.get("Metadata") or {}).get("sha256") != sha256:
            raise self._corrupt(rel_path, str((head.get("Metadata") or {}).get("sha256")), sha256)
        return str(self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": key,
                    "ResponseContentDisposition": f'attachment; filename="{filename}"'},
            ExpiresIn=int(expires_s),
        ))

    # -- the machine's side -----------------------------------------------------------------
    def release(self, path: Path | None = None) -> None:
        """Let cached files be evicted again: `path` (a fetched path, once its reader is done:
        the web after sending a download), or everything this process read (a worker when a
        job ends), then trim the cache to its cap."""
        if path is not None:
            unpin(path)
            return
        release_pins()
        self.cache.evict()

    def scratch_root(self) -> Path:
        return self.cache.scratch

    def local_roots(self) -> list[Path]:
        return []  # nothing local is addressable by path: cached copies are no one's root

    def check(self) -> str:
        """Write, read back and delete a probe object (fisherlens doctor)."""
        data = f"fisherlens doctor {time.time()}".encode()
        key = self.key(f".doctor/probe-{hashlib.sha256(data).hexdigest()[:12]}")
        self._call(f"writing {key}", self.client.put_object, Bucket=self.bucket, Key=key, Body=data)
        back = self._get_bytes(key)
        self._call(f"deleting {key}", self.client.delete_object, Bucket=self.bucket, Key=key)
        if back != data:
            raise ArtifactError(f"artifact store {self.url}: a probe object read back different bytes")
        return f"{self.url}: write, read back and delete ok; cache {self.cache.root}"


def make_client(settings: Any) -> Any:
    """A boto3 S3 client from the settings (AWS_* there, else boto3's own chain: env, ~/.aws)."""
    import boto3
    from botocore.config import Config

    secret = settings.aws_secret_access_key
    kwargs: dict[str, Any] = {
        "endpoint_url": settings.aws_endpoint_url or None,
        "aws_access_key_id": settings.aws_access_key_id or None,
        "aws_secret_access_key": secret.get_secret_value() if secret is not None else None,
        "region_name": settings.aws_default_region or None,
    }
    config = Config(
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        s3={"addressing_style": "path"} if settings.aws_endpoint_url else {},
        max_pool_connections=16,
        signature_version="s3v4",  # presigned URLs too (MinIO and current S3 want SigV4)
    )
    return boto3.session.Session().client("s3", config=config, **kwargs)
