"""A throwaway PostgreSQL schema for a test or a test module: one helper instead of a copy in
every test file that runs on PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

from sqlalchemy import text

from tests.conftest import require_service

PG_URL = os.environ.get(
    "FISHERLENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@contextlib.contextmanager
def pg_schema_url(prefix: str = "fl_test") -> Iterator[str]:
    """The URL of a fresh schema (as search_path) at FISHERLENS_TEST_PG_URL; afterwards the
    engines storage cached for it are disposed and the schema dropped. A skip (a failure under
    CI) when PostgreSQL is not reachable."""
    from storage.db import make_engine

    try:
        admin = make_engine(PG_URL, connect_args={"connect_timeout": 3})
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any connection error: the service is missing
        require_service(
            f"PostgreSQL not reachable at {PG_URL} ({type(exc).__name__}); "
            "set FISHERLENS_TEST_PG_URL"
        )
    schema = f"{prefix}_{secrets.token_hex(6)}"
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in PG_URL else "?"
    try:
        yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        from storage.db import _engines

        for url in [u for u in _engines if schema in u]:
            _engines.pop(url).dispose()
        from app.auth import token_cache

        token_cache.disable_urls(lambda u: schema in u)  # its LISTEN connection closes
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
