"""The workers table (storage.models.WorkerDevice): what each live worker's device offers a job.

A worker writes its row (`publish`) at start, after each job and with every reconcile beat
(`touch`), and removes it when it shuts down (`remove`); the web's estimate reads the rows seen
within `LIVE_AFTER_S` (`live`). A worker killed without shutting down stops being seen and drops
out of `live` by itself.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from storage.models import WorkerDevice, utcnow

# A row not seen for this long is not a live worker's (a worker refreshes it every
# RECONCILE_INTERVAL_S, 30 s by default; three beats missed, or two minutes, whichever is longer)
LIVE_AFTER_S = 120.0
FIELDS = ("host", "device", "device_name", "free_bytes", "total_bytes", "host_free_bytes",
          "seconds_per_token_pass", "seconds_per_param_token_pass", "torch_version")


def publish(*, session: Session, name: str, **fields: Any) -> None:
    """Insert or replace worker `name`'s row with `fields` (FIELDS; those not given are kept)."""
    bad = set(fields) - set(FIELDS)
    if bad:
        raise ValueError(f"fields: {sorted(bad)} are not columns of workers ({', '.join(FIELDS)})")
    row = session.get(WorkerDevice, name)
    if row is None:
        row = WorkerDevice(name=name, host="", device="cpu", device_name="", torch_version="")
        session.add(row)
    for k, v in fields.items():
        setattr(row, k, v)
    row.seen_at = utcnow()
    session.commit()


def touch(*, session: Session, name: str) -> bool:
    """Mark worker `name` as seen now; False when it has no row (it was removed or never wrote)."""
    res = session.execute(update(WorkerDevice).where(WorkerDevice.name == name).values(seen_at=utcnow()))
    session.commit()
    return bool(getattr(res, "rowcount", 0))


def remove(*, session: Session, name: str) -> None:
    session.execute(delete(WorkerDevice).where(WorkerDevice.name == name))
    session.commit()


def live(*, session: Session, within_s: float = LIVE_AFTER_S, now: datetime | None = None) -> list[dict[str, Any]]:
    """The rows seen within `within_s`, as dicts (name, FIELDS, seen_at), by name."""
    since = (now or utcnow()) - timedelta(seconds=within_s)
    rows = session.scalars(select(WorkerDevice).where(WorkerDevice.seen_at >= since)
                           .order_by(WorkerDevice.name)).all()
    return [{"name": r.name, **{k: getattr(r, k) for k in FIELDS}, "seen_at": r.seen_at} for r in rows]
