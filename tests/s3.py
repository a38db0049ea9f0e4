"""A real S3-compatible server for the object-store tests: moto in server mode, in this process
(moto[server], a dev dependency; missing: a skip, or a failure under CI), on a free port. Its objects live in this process's memory, so
`stop()` then `start()` is the store going down and coming back with its data (what an S3 or
MinIO outage looks like to fisherlens); `env` is what a worker process needs to reach it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

BUCKET = "fisherlens-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoS3:
    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: Any = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents") or [])


@contextmanager
def moto_s3() -> Iterator[MotoS3]:
    """A running server with the test bucket (the moto state is per process: every test uses
    its own prefix)."""
    try:
        import moto.server  # noqa: F401
    except ImportError as exc:
        from tests.conftest import require_service

        require_service(f"moto[server] is not installed ({exc}); `pip install -e .[dev]`")
    server = MotoS3()
    server.start()
    try:
        c = server.client()
        if BUCKET not in [b["Name"] for b in c.list_buckets().get("Buckets", [])]:
            c.create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()
