"""What the CLI's queue commands (submit, status, jobs, cancel, rerun, workers) call: the same functions
as app.services, run either

* over HTTP, against a server, when `FISHERLENS_URL` is set or `fisherlens login` saved one:
  every request carries `Authorization: Bearer <token>` (`FISHERLENS_TOKEN`, else the saved
  token), so the server applies the user's ownership, quotas and cost ceiling; or
* in this process, against the database of the current settings (the embedded default and
  machines with direct database access): as the user owning `FISHERLENS_TOKEN` when it is set,
  else as the local admin user `local` (whoever can open the database can change it anyway).

Errors are the ones services raise (SpecError, QuotaExceeded, LookupError, ValueError,
RuntimeError); a refused credential exits 1 with the server's reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from compute.contract.specs import SpecError

# `fisherlens login` / `logout` (app/commands/users.py) save and remove them through this module
from compute.integrations.credentials import (  # noqa: F401
    credentials_path,
    load_credentials,
    login_hint,
    save_credentials,
    server_and_token,
)


class ClientError(Exception):
    """An answer the caller should report as it is and stop on (the CLI prints the message and
    exits with `code`; a script catches it). The client never exits the process itself."""

    code = 1


class Refused(ClientError):
    """The server (401/403) or the local database refused the credential."""


class NotRemote(ClientError):
    """An option the server's API does not offer (a usage error: exit status 2)."""

    code = 2


def remote() -> tuple[str, str | None] | None:
    """(server URL, token) when the CLI should talk HTTP, else None. FISHERLENS_TOKEN goes to
    whatever FISHERLENS_URL names; the token `fisherlens login` saved goes only to the server it
    was saved for (compute.integrations.credentials.server_and_token, the TRL callback's rule too)."""
    url, token = server_and_token()
    if not url:
        return None
    return url, token


def request(method: str, url: str, token: str | None, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url}{path}", data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            payload = json.loads(exc.read() or b"null")
        except json.JSONDecodeError:
            payload = {"detail": exc.reason}
        return exc.code, payload
    except urllib.error.URLError as exc:
        raise RuntimeError(f"cannot reach the fisherlens server at {url}: {exc.reason}") from None


def _raise_for(status: int, payload: Any, job_id: int | None = None,
               server: tuple[str, str | None] | None = None) -> None:
    """`server`: the (URL, token) the request went to, for the hint of a refused credential."""
    from app.limits import ConfirmationRequired, QuotaExceeded

    detail = payload.get("detail") if isinstance(payload, dict) else payload
    if status < 400:
        return
    if status in (401, 403):
        where = f"the server at {server[0]}" if server else "the server"
        hint = f" ({login_hint(server[0] if server else None, bool(server and server[1]))})" \
            if status == 401 else ""
        raise Refused(f"{where} refused: {detail}{hint}")
    if status == 404:
        raise LookupError(detail if isinstance(detail, str) else f"job: no job with id {job_id}")
    if status == 429 and isinstance(detail, list):
        raise QuotaExceeded(detail)
    if status == 422 and isinstance(detail, list):
        if any(isinstance(e, dict) and e.get("field") == "confirm" for e in detail):
            raise ConfirmationRequired(detail)
        raise SpecError(detail)
    if status == 409:
        raise ValueError(str(detail))
    raise RuntimeError(f"server answered {status}: {detail}")


@contextlib.contextmanager
def _local_user() -> Iterator[Any]:
    from app import auth
    from compute.contract.settings import get_settings

    settings = get_settings()
    token = os.environ.get("FISHERLENS_TOKEN")
    if token:
        p = auth.token_principal(settings, token)
        if p is None:
            raise Refused("FISHERLENS_TOKEN is not a valid token for this database (revoked or mistyped)")
    else:
        p = auth.local_principal(settings)
    with auth.acting_as(p):
        yield settings


def submit(settings: Any, kind: str, data: dict[str, Any], *, reuse: bool = True,
           confirm: bool = False) -> dict[str, Any]:
    r = remote()
    if r is None:
        from app import services

        with _local_user() as s:
            return services.submit(s, kind, data, reuse=reuse, confirm=confirm)
    if not reuse:
        raise NotRemote("--no-reuse: not available through the server's API; submit, then "
                        "`fisherlens rerun JOB_ID` to compute a stored result again")
    status, payload = request("POST", r[0], r[1], "/api/jobs",
                              {"kind": kind, "spec": data, "confirm": confirm})
    _raise_for(status, payload, server=r)
    return dict(payload)


def get_job(settings: Any, job_id: int) -> dict[str, Any] | None:
    r = remote()
    if r is None:
        from app import services

        with _local_user() as s:
            return services.get_job(s, job_id)
    status, payload = request("GET", r[0], r[1], f"/api/jobs/{int(job_id)}")
    if status == 404:
        return None
    _raise_for(status, payload, job_id, r)
    return dict(payload)


def list_jobs(settings: Any, limit: int = 100, **filters: Any) -> list[dict[str, Any]]:
    r = remote()
    if r is None:
        from app import services

        with _local_user() as s:
            return services.list_jobs(s, limit=limit, **filters)
    query = urllib.parse.urlencode({"limit": limit, **{k: v for k, v in filters.items() if v}})
    status, payload = request("GET", r[0], r[1], f"/api/jobs?{query}")
    _raise_for(status, payload, server=r)
    return list(payload)


def _job_action(action: str, job_id: int) -> dict[str, Any]:
    """services.<action>(job_id) in this process, or POST /api/jobs/<id>/<action>."""
    r = remote()
    if r is None:
        from app import services

        with _local_user() as s:
            return dict(getattr(services, action)(s, job_id))
    status, payload = request("POST", r[0], r[1], f"/api/jobs/{int(job_id)}/{action}")
    _raise_for(status, payload, job_id, r)
    return dict(payload)


def cancel(settings: Any, job_id: int) -> dict[str, Any]:
    return _job_action("cancel", job_id)


def rerun(settings: Any, job_id: int) -> dict[str, Any]:
    return _job_action("rerun", job_id)


def workers(settings: Any) -> dict[str, Any]:
    """services.workers here (no user needed: it reads the workers table), or GET /api/workers."""
    r = remote()
    if r is None:
        from app import services

        return services.workers(settings)
    status, payload = request("GET", r[0], r[1], "/api/workers")
    _raise_for(status, payload, server=r)
    return dict(payload)
