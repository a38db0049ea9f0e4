"""`fisherlens doctor`: check every service this machine's settings name, with a clear line each.

    ok    settings        ...
    ok    database        postgresql+psycopg://fisherlens:***@db:5432/fisherlens: reachable, schema at head
    FAIL  broker          redis://redis:6379/0: cannot connect (ConnectionError ...); is Redis running? check REDIS_URL
    ok    artifact store  s3://fisherlens/artifacts: write, read back and delete ok; cache ...
    ok    model roots     zoo: arith-base, ...; ALLOWED_MODEL_ROOTS: /models
    warn  workers         no live worker: queued jobs wait until one starts (`fisherlens worker`)

Exit status 1 when any check FAILs (warnings do not), so a worker's start script can run it
first (docker-compose.yml does). No torch is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

Check = tuple[str, str]  # (status: ok | warn | FAIL, message)


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def check_database(settings: Any) -> Check:
    from alembic.script import ScriptDirectory

    from storage.db import alembic_config, current_revision, make_engine

    shown = _safe_url(settings.db_url)
    try:
        engine = make_engine(settings.db_url, **(
            {"connect_args": {"connect_timeout": 5}} if settings.db_url.startswith("postgresql") else {}
        ))
        try:
            rev = current_revision(engine)
        finally:
            engine.dispose()
    except Exception as exc:  # noqa: BLE001 - any driver error: say which and where to look
        return "FAIL", (f"{shown}: cannot connect ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                        "is the database running? check DATABASE_URL")
    head = ScriptDirectory.from_config(alembic_config(settings.db_url)).get_current_head()
    if rev != head:
        return "warn", (f"{shown}: reachable, schema at {rev or 'none'} but this code expects "
                        f"{head}; run `fisherlens db upgrade` (workers and the app also do at start)")
    return "ok", f"{shown}: reachable, schema at head ({head})"


def check_broker(settings: Any) -> Check:
    if settings.redis_url:
        import redis

        try:
            redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5,
                                 socket_timeout=5).ping()
        except Exception as exc:  # noqa: BLE001
            return "FAIL", (f"{settings.redis_url}: cannot connect ({type(exc).__name__}: {exc}); "
                            "is Redis running? check REDIS_URL")
        return "ok", f"{settings.redis_url}: PING answered"
    queue = Path(settings.queue_dir)
    try:
        queue.mkdir(parents=True, exist_ok=True)
        probe = queue / f".doctor-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        return "FAIL", f"filesystem queue {queue}: not writable ({exc.strerror}); check FISHERLENS_HOME"
    return "ok", f"filesystem queue {queue} (embedded: this machine only)"


def check_store(settings: Any) -> Check:
    from storage.artifacts import open_store

    try:
        store = open_store(settings)
        message = store.check()
    except Exception as exc:  # noqa: BLE001 - ArtifactStoreUnavailable, credentials, DNS, ...
        where = settings.artifact_url or str(settings.artifacts_dir)
        hint = ("; check ARTIFACT_URL, AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY"
                if settings.artifact_url else "; check ARTIFACT_ROOT")
        text = str(exc) if str(exc).startswith("artifact") else f"{where}: {type(exc).__name__}: {exc}"
        return "FAIL", text + hint
    if store.remote:
        from storage.artifact_cache import ArtifactCache

        cache = ArtifactCache(settings.artifact_cache, settings.artifact_cache_max_bytes)
        message += (f" ({cache.size() / 2**20:.1f} MiB of {settings.artifact_cache_max_bytes / 2**20:.0f}"
                    " MiB used)")
    return "ok", message


def check_models(settings: Any) -> Check:
    from compute.contract.modelref import REAL_MODEL_NAMES, ZOO_NAMES

    zoo = Path(settings.zoo_dir)
    built = [n for n in (*ZOO_NAMES, *REAL_MODEL_NAMES) if (zoo / n / "config.json").is_file()]
    roots = [Path(p).expanduser() for p in settings.allowed_model_roots.split(":") if p]
    missing = [str(r) for r in roots if not r.is_dir() or not os.access(r, os.R_OK | os.X_OK)]
    shown_roots = ", ".join(str(r) for r in roots) or "none"
    if missing:
        return "FAIL", (f"ALLOWED_MODEL_ROOTS: {', '.join(missing)} not a readable folder on this "
                        "machine (mount it, or remove it from the list)")
    if not built:
        return "warn", (f"zoo {zoo}: no model built; run `fisherlens zoo build` (every worker "
                        f"machine needs its own); ALLOWED_MODEL_ROOTS: {shown_roots}")
    return "ok", f"zoo {zoo}: {', '.join(built)}; ALLOWED_MODEL_ROOTS: {shown_roots}"


def check_topology(settings: Any) -> Check:
    """Settings that cannot work across machines, said before a second machine finds out."""
    shared = [name for name, local in (
        ("the database (SQLite; set DATABASE_URL)", settings.database_url is None),
        ("the broker (filesystem queue; set REDIS_URL)", settings.redis_url is None),
        ("artifacts (a local folder; set ARTIFACT_URL=s3://..., or share ARTIFACT_ROOT)",
         settings.artifact_url is None),
    ) if local]
    if not shared:
        return "ok", "database, broker and artifact store are network services: ready for workers " \
                     "on other machines"
    if len(shared) == 3:
        return "ok", "embedded (one machine): SQLite, filesystem queue and artifact folder"
    return "warn", ("workers on other machines cannot reach " + "; ".join(shared))


def check_workers(settings: Any) -> Check:
    """The live workers' devices (`fisherlens workers`): none is a warning (queued jobs wait), not
    a failure (a worker's own start script runs doctor before it writes its row)."""
    from app.limits import size_text
    from app.services.workers import workers

    out = workers(settings)
    rows = out["workers"]
    if not rows:
        return "warn", "no live worker: queued jobs wait until one starts (`fisherlens worker`)"
    shown = "; ".join(f"{w['name']} ({w['device']}"
                      + (f", {size_text(float(w['free_bytes']))} free" if w["free_bytes"] is not None else "")
                      + ")" for w in rows[:4]) + (f"; and {len(rows) - 4} more" if len(rows) > 4 else "")
    return "ok", f"{len(rows)} live: {shown}; details: `fisherlens workers`"


CHECKS: list[tuple[str, Callable[[Any], Check]]] = [
    ("database", check_database),
    ("broker", check_broker),
    ("artifact store", check_store),
    ("model roots", check_models),
    ("deployment", check_topology),
    ("workers", check_workers),
]


def run_checks(settings: Any) -> list[tuple[str, str, str]]:
    out = []
    for name, fn in CHECKS:
        try:
            status, message = fn(settings)
        except Exception as exc:  # noqa: BLE001 - a check must never hide the others
            status, message = "FAIL", f"{type(exc).__name__}: {exc}"
        out.append((name, status, message))
    return out


@click.command("doctor")
def doctor_cmd() -> None:
    """Check every service the settings name (database, broker, artifact store read/write, model
    roots) and list the live workers: one line each; exit 1 if any fails."""
    from pydantic import ValidationError

    from compute.contract.settings import get_settings

    try:
        settings = get_settings()
    except ValidationError as exc:
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]).upper()
            click.echo(f"FAIL  settings        {field}: {err['msg']}")
        raise SystemExit(1) from None
    click.echo(f"ok    settings        FISHERLENS_HOME={settings.home}")
    results = run_checks(settings)
    for name, status, message in results:
        click.echo(f"{status:<5} {name:<15} {message}")
    failed = [name for name, status, _ in results if status == "FAIL"]
    if failed:
        click.echo(f"doctor: {len(failed)} check(s) failed: {', '.join(failed)}", err=True)
        raise SystemExit(1)


commands: list[click.Command] = [doctor_cmd]
