"""Engine, session factory and schema upgrade.

`make_engine(url)` is the only place engines are built, so tests hand it SQLite or PostgreSQL.
No session lives at module level: callers open `session_factory(url)()`.
Mutating repository functions commit their own unit of work (see storage/repo.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_factories: dict[str, sessionmaker[Session]] = {}


def make_engine(url: str, **kwargs: Any) -> Engine:
    """A new Engine for `url` (SQLite: parent folder created, WAL, foreign keys on, 30 s busy wait)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {"timeout": 30, "check_same_thread": False})
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if u.get_backend_name() == "postgresql":  # a server that is away answers within seconds
        kwargs.setdefault("connect_args", {"connect_timeout": 10})
        # as many connections as the threads that may want one at once: the web process runs
        # sync routes in Starlette's threadpool (40 threads); the default pool (5 + 10) made the
        # 41st..15th concurrent request wait for a connection. 10 stay open, the rest close
        # when returned.
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 40)
    return create_engine(url, **kwargs)


def is_outage(exc: BaseException) -> bool:
    """Is this error the database being unreachable (stopped, restarting, network, a dropped
    connection) rather than a bug or bad data? Such an operation can be retried as it was."""
    if isinstance(exc, DisconnectionError | OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def _get_engine_unlocked(url: str) -> Engine:
    if url not in _engines:
        _engines[url] = make_engine(url)
    return _engines[url]


READ_SUFFIX = "#read"  # the key of a URL's read engine in _engines


def read_engine(url: str) -> Engine:
    """A second shared engine for `url` without pre-ping and in autocommit, for the one-statement
    reads a page or a client polls (a job listing): pre-ping is one more round trip per
    checkout, a transaction two more. A connection that died (the
    database restarted) is retried once on a fresh one by `read`."""
    key = url + READ_SUFFIX
    engine = _engines.get(key)
    if engine is not None:
        return engine
    with _lock:
        if make_url(url).get_backend_name() == "sqlite":  # no round trip to save (and :memory:)
            engine = _get_engine_unlocked(url)
        else:
            # autocommit: a listing is one SELECT (its own snapshot), so no BEGIN before it and
            # no ROLLBACK when the connection goes back to the pool: two round trips fewer
            engine = _engines.get(key) or make_engine(url, pool_pre_ping=False, isolation_level="AUTOCOMMIT")
        _engines[key] = engine
        return engine


def read(url: str, fn: Any) -> Any:
    """fn(connection) on read_engine(url); once more on a fresh connection when the first one
    turns out dead (what pre-ping would have caught)."""
    for attempt in (1, 2):
        try:
            with read_engine(url).connect() as conn:
                return fn(conn)
        except DBAPIError as exc:
            if attempt == 2 or not exc.connection_invalidated:
                raise
    return None  # not reached


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def session_factory(url: str) -> sessionmaker[Session]:
    """The shared session factory for `url` (e.g. `settings.db_url`)."""
    with _lock:
        if url not in _factories:
            _factories[url] = make_session_factory(_get_engine_unlocked(url))
        return _factories[url]


_upgraded: set[str] = set()
_upgrade_lock = threading.Lock()


def migrated_session_factory(url: str) -> sessionmaker[Session]:
    """session_factory(url), after upgrading the schema to head once per process (web, CLI)."""
    with _upgrade_lock:
        if url not in _upgraded:
            upgrade(url)
            _upgraded.add(url)
    return session_factory(url)


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Apply Alembic migrations up to `revision`. Safe when app and workers start together:
    PostgreSQL serialises on an advisory lock, SQLite on a file lock next to the database."""
    from alembic import command

    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    url = engine.url.render_as_string(hide_password=False)
    try:
        with _migration_lock(engine):
            with engine.begin() as conn:
                cfg = alembic_config(url)
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    backend = engine.url.get_backend_name()
    if backend == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(73411)"))
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(73411)"))
                conn.commit()
    elif backend == "sqlite" and engine.url.database not in (None, "", ":memory:"):
        import fcntl

        lock_path = Path(str(engine.url.database)).expanduser().with_suffix(".migrate.lock")
        with open(lock_path, "a+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    else:
        yield


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
