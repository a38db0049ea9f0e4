"""A mask of a fisherlens server's job (`job:N`), downloaded through its REST API for
`FisherMaskCallback("job:12", server=..., token=...)`.

    path = fetch_mask("job:12", server="http://host:8000", token="...")  # or FISHERLENS_URL / _TOKEN
    path = fetch_mask("job:12")  # after `fisherlens login`: its saved server and token

Server and token: the arguments, else FISHERLENS_URL / FISHERLENS_TOKEN, else what `fisherlens
login` saved (compute/integrations/credentials.py; the saved token only goes to the saved server).

What it asks the server (every request carries `Authorization: Bearer <token>`, the API token
`fisherlens user token` / `fisherlens login` gives):
1. GET /api/jobs/N: the job exists and is the caller's (another user's job answers 404, exactly like
   a job that does not exist), is of a kind that stores a mask (a mask job; a train job's mask is
   the one it trained with) and has succeeded;
2. GET /api/results/<share token>: its `mask` artifact and that artifact's recorded sha256;
3. GET /api/results/<share token>/artifacts/mask: the file, streamed to a temporary file, its
   sha256 checked against the recorded one, then moved into the cache.
The cache is content-addressed (`<cache>/<sha256>.safetensors`; default
`$FISHERLENS_CACHE/masks` or `~/.cache/fisherlens/masks`): a mask already there (its sha256
re-checked) is not downloaded again. Every refusal is a ValueError naming the job, the server and
the HTTP status (or the network error).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

_JOB = re.compile(r"^job:(\d{1,12})$")


def job_id(ref: str) -> int | None:
    """12 for 'job:12', None for anything else."""
    m = _JOB.match(ref.strip())
    return int(m.group(1)) if m else None


def default_cache() -> Path:
    base = os.environ.get("FISHERLENS_CACHE") or str(Path.home() / ".cache" / "fisherlens")
    return Path(base).expanduser() / "masks"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Server:
    def __init__(self, what: str, url: str, token: str | None, timeout: float):
        self.what, self.url, self.token, self.timeout = what, url.rstrip("/"), token, timeout

    def _open(self, path: str) -> Any:
        req = urllib.request.Request(self.url + path)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read() or b"null")
                detail = detail.get("detail") if isinstance(detail, dict) else detail
            except ValueError:
                detail = exc.reason
            raise _HTTPStatus(exc.code, str(detail)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ValueError(f"{self.what}: the fisherlens server at {self.url} cannot be reached "
                             f"({reason}); check server= / FISHERLENS_URL") from None

    def json(self, path: str) -> Any:
        with self._open(path) as resp:
            return json.loads(resp.read())


class _HTTPStatus(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


def fetch_mask(
    ref: str, server: str | None = None, token: str | None = None, *,
    cache_dir: str | Path | None = None, timeout: float = 60.0,
) -> Path:  # fmt: skip
    """The local, sha256-verified file of the mask of job `ref` ('job:N') on a fisherlens server
    (`server`, else FISHERLENS_URL, else the URL `fisherlens login` saved; `token`, else
    FISHERLENS_TOKEN, else the saved token when the server is the saved one). ValueError naming the job,
    the server and the HTTP status when it cannot be used (see the module docstring)."""
    n = job_id(ref)
    if n is None:
        raise ValueError(f"mask: {ref[:40]!r} is not a job reference; write job:<number>, e.g. job:12")
    from compute.integrations.credentials import server_and_token

    url, token = server_and_token(server, token)
    if not url:
        raise ValueError(f"mask: job:{n} is a job of a fisherlens server: pass server='http://host:port' "
                         "(and token=...), set FISHERLENS_URL (and FISHERLENS_TOKEN) or run "
                         "`fisherlens login`")
    what = f"mask job:{n}"
    srv = _Server(what, url, token, timeout)
    try:
        job = srv.json(f"/api/jobs/{n}")
    except _HTTPStatus as exc:
        if exc.status == 404:
            raise ValueError(f"{what}: the server at {srv.url} has no job {n} you may use (HTTP 404: "
                             "it does not exist or belongs to another user)") from None
        if exc.status in (401, 403):
            from compute.integrations.credentials import login_hint

            hint = (login_hint(srv.url, False) if not token else
                    "set FISHERLENS_TOKEN or run `fisherlens login` with a valid token")
            raise ValueError(f"{what}: the server at {srv.url} refused the {'token' if token else 'request'} "
                             f"(HTTP {exc.status}: {exc.detail}); pass token=, or {hint}") from None
        raise ValueError(f"{what}: the server at {srv.url} answered HTTP {exc.status}: {exc.detail}") from None
    from compute.jobs import registry

    providers = registry.producers("mask")  # the kinds whose succeeded jobs store a mask
    kind, status = job.get("kind"), job.get("status")
    if kind not in providers:
        raise ValueError(f"{what}: job {n} is a {kind} job; a mask job (or a train job, its mask) is needed")
    if status != "succeeded":
        raise ValueError(f"{what}: job {n} is {status}; only a succeeded {kind} job has a mask")
    share = job["share_token"]
    try:
        result = srv.json(f"/api/results/{share}")
    except _HTTPStatus as exc:
        raise ValueError(f"{what}: its result could not be read (HTTP {exc.status}: {exc.detail})") from None
    arts = {a["kind"]: a for a in result.get("artifacts") or []}
    if "mask" not in arts:
        raise ValueError(f"{what}: job {n} has no mask artifact (it has: {', '.join(arts) or 'none'})")
    sha = str(arts["mask"].get("sha256") or "")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ValueError(f"{what}: the server reports no sha256 for its mask; refusing an unverifiable file")

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache()
    cached = cache / f"{sha}.safetensors"
    if cached.is_file() and _sha256(cached) == sha:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".download-", suffix=".safetensors", dir=cache)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                resp = srv._open(f"/api/results/{share}/artifacts/mask")
            except _HTTPStatus as exc:
                raise ValueError(f"{what}: the download was refused (HTTP {exc.status}: {exc.detail})") from None
            with resp:
                for chunk in iter(lambda: resp.read(1 << 20), b""):
                    h.update(chunk)
                    out.write(chunk)
        if h.hexdigest() != sha:
            raise ValueError(f"{what}: the downloaded file's sha256 {h.hexdigest()[:12]}... does not match "
                             f"the recorded {sha[:12]}... (corrupt or changed in transit); nothing was kept")
        os.replace(tmp, cached)
    finally:
        tmp.unlink(missing_ok=True)
    return cached
