"""The object-store backend (storage/s3store.py) against a real S3-compatible server (moto in
server mode, tests/s3.py): what one machine writes another reads back verified, multipart for
large files, folders as objects under one prefix with a manifest, a corrupted object refused by
sha256, a store going down mid-upload (nothing published; retried by a worker), presigned
downloads, and the figures of share pages stored the same way."""

from __future__ import annotations

import hashlib
import secrets
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from compute.contract.settings import Settings
from storage.artifact_cache import pinned, release_pins
from storage.artifacts import (
    ArtifactError,
    ArtifactMissing,
    ArtifactStore,
    ArtifactStoreUnavailable,
    on_uploaded,
    open_store,
    sha256_dir,
    upload_retries,
)
from storage.s3store import S3ArtifactStore
from tests.s3 import BUCKET, MotoS3, moto_s3


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with moto_s3() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"t{secrets.token_hex(4)}"


def _settings(s3: MotoS3, prefix: str, home: Path, **kw) -> Settings:
    return Settings(fisherlens_home=home, artifact_url=s3.url(prefix), aws_endpoint_url=s3.endpoint,
                    aws_access_key_id="testing", aws_secret_access_key="testing",
                    aws_default_region="us-east-1", **kw)


def _machine(s3: MotoS3, prefix: str, home: Path, **kw) -> S3ArtifactStore:
    """The store as one machine (its own FISHERLENS_HOME, so its own cache) sees it."""
    store = open_store(_settings(s3, prefix, home, **kw))
    assert isinstance(store, S3ArtifactStore)
    return store


@pytest.fixture(autouse=True)
def _unpin() -> Iterator[None]:
    yield
    release_pins()


def test_open_store_chooses_the_backend_from_the_settings(s3, prefix, tmp_path) -> None:
    assert isinstance(open_store(Settings(fisherlens_home=tmp_path)), ArtifactStore)
    store = _machine(s3, prefix, tmp_path)
    assert store.bucket == BUCKET and store.prefix == prefix
    assert open_store(_settings(s3, prefix, tmp_path)) is store  # one client per process
    with pytest.raises(ValueError, match="ARTIFACT_URL: 'http://x/y' is not an object-store URL"):
        Settings(artifact_url="http://x/y")
    with pytest.raises(ValueError, match="ARTIFACT_URL"):
        Settings(artifact_url="s3://ok-bucket/../escape")


def test_tensors_written_on_one_machine_read_verified_on_another(s3, prefix, tmp_path) -> None:
    a = _machine(s3, prefix, tmp_path / "a")
    b = _machine(s3, prefix, tmp_path / "b")
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3)}
    info = a.save_tensors(5, "fisher", tensors)
    assert (info.path, info.kind) == ("5/fisher.safetensors", "fisher")
    assert s3.keys(prefix) == [f"{prefix}/5/fisher.safetensors"]
    head = s3.client().head_object(Bucket=BUCKET, Key=f"{prefix}/5/fisher.safetensors")
    assert head["Metadata"]["sha256"] == info.sha256 and head["ContentLength"] == info.bytes
    path = b.fetch(info.path, info.sha256)
    assert path.name == "fisher.safetensors" and path.is_relative_to(b.cache.root)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == info.sha256
    got = b.load_tensors(info.path, info.sha256)
    assert set(got) == {"w", "b"} and torch.equal(got["w"], tensors["w"])
    # the writer seeded its own cache: no download there, same bytes
    assert a.cache.get(info.sha256, "fisher.safetensors") is not None
    # the same content as the folder backend writes
    folder = ArtifactStore(tmp_path / "folder").save_tensors(5, "fisher", tensors)
    assert folder.sha256 == info.sha256 and folder.path == info.path


def test_large_files_go_multipart_and_come_back_identical(s3, prefix, tmp_path) -> None:
    from boto3.s3.transfer import TransferConfig

    a = _machine(s3, prefix, tmp_path / "a")
    # S3's smallest part is 5 MiB: a 12 MiB file in 5 MiB parts is three parts.
    a.transfer = TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    data = torch.randn(3 * 2**20).numpy().tobytes()  # 12 MiB
    info = a.save_bytes(9, "big.bin", data)
    etag = s3.client().head_object(Bucket=BUCKET, Key=f"{prefix}/9/big.bin")["ETag"].strip('"')
    assert etag.endswith("-3"), etag  # the multipart ETag: md5 of the parts' md5s, "-<parts>"
    b = _machine(s3, prefix, tmp_path / "b")
    b.transfer = a.transfer
    assert b.fetch(info.path, info.sha256).read_bytes() == data


def _model_folder(root: Path) -> Path:
    src = root / "model-src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "model.safetensors").write_bytes(b"\x01" * 1000)
    (src / "sub" / "tokenizer.json").write_text('{"t": 2}')
    return src


def test_a_model_folder_is_objects_under_one_prefix(s3, prefix, tmp_path) -> None:
    a = _machine(s3, prefix, tmp_path / "a")
    src = _model_folder(tmp_path)
    expected = sha256_dir(src)
    info = a.save_folder(3, "model", src)
    assert (info.path, info.is_dir, (info.sha256, info.bytes)) == ("3/model", True, expected)
    assert s3.keys(prefix) == [f"{prefix}/3/model.dir.json", f"{prefix}/3/model/config.json",
                               f"{prefix}/3/model/model.safetensors",
                               f"{prefix}/3/model/sub/tokenizer.json"]
    assert not src.exists()  # moved into the writer's cache
    b = _machine(s3, prefix, tmp_path / "b")
    got = b.fetch(info.path, info.sha256)
    assert got.name == "model" and (got / "sub" / "tokenizer.json").read_text() == '{"t": 2}'
    assert sha256_dir(got) == expected


def test_a_corrupted_object_is_refused_by_sha256(s3, prefix, tmp_path) -> None:
    a = _machine(s3, prefix, tmp_path / "a")
    info = a.save_tensors(7, "fisher", {"w": torch.ones(4)})
    s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/{info.path}", Body=b"not the tensor",
                           Metadata={"sha256": info.sha256})
    b = _machine(s3, prefix, tmp_path / "b")
    with pytest.raises(ArtifactError, match=r"corrupt: sha256 .* does not match the recorded"):
        b.fetch(info.path, info.sha256)
    assert list(b.cache.entries.iterdir()) == []  # nothing unverified entered the cache
    assert list(b.cache.tmp.iterdir()) == []
    with pytest.raises(ArtifactMissing, match="missing from the artifact store"):
        b.fetch("7/mask.safetensors", info.sha256)
    with pytest.raises(ArtifactError, match="outside the artifact store"):
        b.fetch("../other/7/fisher.safetensors", info.sha256)


def test_store_down_mid_folder_upload_publishes_nothing(s3, prefix, tmp_path) -> None:
    """The server stops after the first object of a folder: the upload fails with a clear
    error, no manifest exists (the folder is not fetchable), the source is intact, and the
    next attempt publishes it whole with no stray objects."""
    a = _machine(s3, prefix, tmp_path / "a")
    src = _model_folder(tmp_path)
    uploaded: list[str] = []

    def first_then_down(key: str) -> None:
        uploaded.append(key)
        if len(uploaded) == 1:
            s3.stop()

    try:
        with on_uploaded(first_then_down), pytest.raises(ArtifactStoreUnavailable,
                                                        match="uploading .* failed"):
            a.save_folder(4, "model", src)
    finally:
        s3.start()
    assert uploaded == [f"{prefix}/4/model/config.json"]
    assert src.is_dir() and (src / "model.safetensors").exists()  # kept for the retry
    assert f"{prefix}/4/model.dir.json" not in s3.keys(prefix)
    with pytest.raises(ArtifactMissing):
        _machine(s3, prefix, tmp_path / "b").fetch("4/model", sha256_dir(src)[0])
    info = a.save_folder(4, "model", src)
    assert s3.keys(f"{prefix}/4/") == [f"{prefix}/4/model.dir.json", f"{prefix}/4/model/config.json",
                                       f"{prefix}/4/model/model.safetensors",
                                       f"{prefix}/4/model/sub/tokenizer.json"]
    assert sha256_dir(_machine(s3, prefix, tmp_path / "c").fetch(info.path, info.sha256))[0] == info.sha256


def test_a_worker_retries_the_upload_until_the_store_is_back(s3, prefix, tmp_path) -> None:
    a = _machine(s3, prefix, tmp_path / "a")
    s3.stop()
    notes: list[str] = []

    def notify(message: str) -> None:  # the worker writes this as the job's message
        notes.append(message)
        s3.start()  # back after the first wait

    try:
        with pytest.raises(ArtifactStoreUnavailable, match="uploading"):
            a.save_bytes(8, "x.bin", b"payload")  # outside a worker: fails at once
        with upload_retries(60, notify):
            info = a.save_bytes(8, "x.bin", b"payload")
    finally:
        if s3._server is None:
            s3.start()
    assert len(notes) == 1 and "artifact store unreachable while uploading" in notes[0]
    assert "retrying in 1 s" in notes[0]
    assert _machine(s3, prefix, tmp_path / "b").fetch(info.path, info.sha256).read_bytes() == b"payload"


def test_save_result_records_nothing_when_the_upload_fails(s3, prefix, tmp_path) -> None:
    from compute.contract.jobresult import JobResult
    from storage import repo
    from storage.db import migrated_session_factory

    settings = _settings(s3, prefix, tmp_path)
    store = open_store(settings)
    with migrated_session_factory(settings.db_url)() as s:
        job = repo.create_job(session=s, kind="fisher", spec={}, spec_hash="h")
        result = JobResult(kind="fisher", summary={"n": 1}, tensors={"fisher": {"w": torch.ones(2)}})
        s3.stop()
        try:
            with pytest.raises(ArtifactStoreUnavailable):
                repo.save_result(session=s, job_id=job.id, result=result, store=store)
        finally:
            s3.start()
        assert repo.result_dict(session=s, job=repo.get_job(session=s, job_id=job.id))["artifacts"] == []
        repo.save_result(session=s, job_id=job.id, result=result, store=store)
        (art,) = repo.result_dict(session=s, job=repo.get_job(session=s, job_id=job.id))["artifacts"]
    assert art["path"] == f"{job.id}/fisher.safetensors"
    assert store.load_tensors(art["path"], art["sha256"])["w"].tolist() == [1.0, 1.0]


def test_presigned_download_serves_the_exact_bytes(s3, prefix, tmp_path) -> None:
    a = _machine(s3, prefix, tmp_path / "a")
    info = a.save_bytes(2, "mask.safetensors", b"mask-bytes")
    url = a.download_url(info.path, info.sha256, "job2-mask.safetensors", 60)
    assert url is not None and "X-Amz-Expires=60" in url and "Signature" in url
    with urllib.request.urlopen(url) as r:  # noqa: S310 - the test server
        assert r.read() == b"mask-bytes"
        assert 'filename="job2-mask.safetensors"' in r.headers["Content-Disposition"]
    with pytest.raises(ArtifactError, match="corrupt"):
        a.download_url(info.path, "0" * 64, "x", 60)


def test_share_page_figures_live_in_the_object_store(s3, prefix, tmp_path) -> None:
    from app.figures.store import FIGURES_KEY, FigureStore

    payload = {"figures_key": FIGURES_KEY, "job": {"id": 11, "finished_at": "2026-01-01"},
               "figures": [], "tables": [], "numbers": [], "artifacts": []}
    FigureStore(_machine(s3, prefix, tmp_path / "web1")).write(11, payload)
    assert s3.keys(prefix) == [f"{prefix}/11/share-figures.json"]
    other = FigureStore(_machine(s3, prefix, tmp_path / "web2"))  # another web machine
    assert other.get(11, "2026-01-01", lambda: pytest.fail("rebuilt")) == payload
    assert other.read(11, "2027-01-01") is None and other.read(12, "2026-01-01") is None


def test_fetch_pins_until_released(s3, prefix, tmp_path) -> None:
    a = _machine(s3, prefix, tmp_path / "a", artifact_cache_max_bytes=0)
    info = a.save_bytes(1, "f.bin", b"12345")
    assert any(p.endswith(info.sha256) for p in pinned())  # in use: a cap of 0 keeps it
    assert a.cache.get(info.sha256, "f.bin") is not None
    a.release()
    assert pinned() == [] and a.cache.size() == 0  # trimmed to the cap once released
    b = _machine(s3, prefix, tmp_path / "a", artifact_cache_max_bytes=0)
    assert b.fetch(info.path, info.sha256).read_bytes() == b"12345"  # downloaded again
