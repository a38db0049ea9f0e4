"""REST API: jobs, results, downloads, models. No torch (tasks are sent by name via app.services).

Errors speak to the user: 422 {"detail": [{"field", "message"}]} on bad input (nothing queued),
404 {"detail": "..."} for an unknown job id or share token.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask

from app import plots, services
from compute.contract.specs import SpecError
from compute.jobs.registry import NAMES as KIND_NAMES
from storage.models import JOB_STATUSES

ZOO_INFO_FILE = "fisherlens.json"  # written by compute.zoo next to each zoo model (no torch here)


# Enumerated in the OpenAPI schema (the kinds from compute.jobs.registry), so every schema-valid
# filter is accepted.
JobKind: Any = Literal[KIND_NAMES]  # type: ignore[valid-type]
JobStatus: Any = Literal[tuple(JOB_STATUSES)]  # type: ignore[valid-type]


class JobRequest(BaseModel):
    # a string with the registry's kinds as its schema enum: an unknown kind is answered by the
    # spec validation (422 naming the accepted kinds), not a bare schema error
    kind: str = Field(..., description=f"job kind: one of {', '.join(KIND_NAMES)}",
                      json_schema_extra={"enum": list(KIND_NAMES)})
    spec: dict[str, Any] = Field(
        default_factory=dict,
        description="the job spec; keys as the matching CLI flags (see `fisherlens submit`)",
    )
    confirm: bool = Field(
        False, description="queue it although its estimated run time is above the server's "
        "confirmation threshold (CONFIRM_ABOVE_S, default 1 h): without it such a job is answered "
        "422 with field `confirm` and the estimate")

    model_config = {"json_schema_extra": {"examples": [
        {"kind": "fisher", "spec": {"model": "arith-base", "task": "arithmetic", "prompts": 8, "samples": 2}}
    ]}}


class RegisterModel(BaseModel):
    path: str = Field(..., min_length=1, max_length=1000,
                      description="local Hugging Face model folder inside the allowed model roots, "
                      "or job:N of a succeeded train job (its trained model)")
    name: str | None = Field(None, max_length=200, description="display name (default: folder name)")


class FieldError(BaseModel):
    field: str = Field(..., description="the spec key (or request part) that is wrong")
    message: str = Field(..., description="what is wrong and the accepted range or values")


class FieldErrors(BaseModel):
    """422 (and 429): every bad field at once; nothing was queued."""

    detail: list[FieldError]


class Message(BaseModel):
    """Every other error: one sentence for a person (no traceback, no server path)."""

    detail: str


ERRORS: dict[int, tuple[type[BaseModel], str]] = {
    400: (Message, "the request body could not be parsed (not UTF-8 JSON)"),
    401: (Message, "sign-in required (AUTH_REQUIRED servers)"),
    403: (Message, "not allowed, or a cross-site request"),
    404: (Message, "no such job, share token or artifact (ids out of range are simply not found)"),
    409: (Message, "conflict: the job is still queued or running, or the stored artifact does not "
                   "match its recorded sha256 (corrupt); re-run the job"),
    410: (Message, "the artifact is no longer in the artifact store; re-run the job"),
    413: (Message, "request body over the limit"),
    422: (FieldErrors, "bad input: each field and its accepted range; nothing was queued"),
    429: (FieldErrors, "your queue is full (queued + running jobs limit)"),
    500: (Message, "internal error (the server log has the details)"),
    503: (Message, "the database, the job queue (broker) or the artifact store cannot be "
                   "reached; nothing was queued"),
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these status codes, with their error bodies."""
    return {c: {"model": ERRORS[c][0], "description": ERRORS[c][1]} for c in codes}


RETRY_503 = {"Retry-After": "30"}  # a service away: the outages measured were 20-30 s
RETRY_429 = {"Retry-After": "30"}  # the job limit: a slot frees when one of the caller's jobs ends


def spec_error_response(exc: SpecError) -> JSONResponse:
    from app.limits import QuotaExceeded  # a per-user queue limit: 429, like any rate limit

    if isinstance(exc, QuotaExceeded):
        return JSONResponse(status_code=429, content={"detail": exc.errors}, headers=RETRY_429)
    return JSONResponse(status_code=422, content={"detail": exc.errors})


def _not_found(what: str) -> HTTPException:
    return HTTPException(status_code=404, detail=what)


# ---------------------------------------------------------------- models (no torch)


def zoo_models(settings: Any) -> list[dict[str, Any]]:
    """Built zoo models, read from their config.json and fisherlens.json (no torch import)."""
    out: list[dict[str, Any]] = []
    zoo = Path(settings.zoo_dir)
    if not zoo.is_dir():
        return out
    for folder in sorted(p for p in zoo.iterdir() if (p / "config.json").is_file()):
        out.append({"name": folder.name, "source": "zoo", **_folder_info(folder)})
    return out


def _folder_info(folder: Path) -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    try:
        extra = json.loads((folder / ZOO_INFO_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        extra = {}
    archs = cfg.get("architectures") or []
    info["architecture"] = extra.get("architecture") or (archs[0] if archs else cfg.get("model_type"))
    info["n_layers"] = extra.get("n_layers") or cfg.get("num_hidden_layers") or cfg.get("n_layer")
    info["n_params"] = extra.get("n_params") or extra.get("params")
    info["hidden_size"] = cfg.get("hidden_size") or cfg.get("n_embd")
    info["vocab_size"] = cfg.get("vocab_size")
    if extra.get("accuracy") is not None:
        info["accuracy"] = extra["accuracy"]
    # e.g. "smollm2-135m (dequantised from Q4_1)": how model lists show it, with its note
    info["label"] = extra.get("display_name") or folder.name
    info["note"] = extra.get("note") or ""
    info["path"] = str(folder)
    return info


def all_models(settings: Any) -> list[dict[str, Any]]:
    """Zoo models first, then registered local models, then trained models (succeeded train
    jobs): name, source, architecture, sizes, and `ref`, the value a job's model, teacher, base
    or tuned field takes (zoo: the name; registered: its folder; trained: job:N)."""
    rows = [{**r, "ref": r["name"], "path": None} for r in zoo_models(settings)]  # no server path
    names = {r["name"] for r in rows}
    for m in services.list_models(settings):
        if m["name"] in names:
            continue
        rows.append({
            "name": m["name"], "source": m["source"], "architecture": m["architecture"],
            "n_layers": m["n_layers"], "n_params": m["n_params"],
            "hidden_size": (m.get("info") or {}).get("hidden_size"),
            "vocab_size": (m.get("info") or {}).get("vocab_size"),
            "path": m["source"], "ref": m["source"],
        })
    for t in services.trained_models(settings):
        rows.append({"name": t["label"], "source": "job", "architecture": None, "n_layers": None,
                     "n_params": None, "hidden_size": None, "vocab_size": None, "path": None,
                     "ref": t["ref"]})
    return rows


def model_name_problem(settings: Any, label: str) -> str | None:
    """Why `label` cannot name a registered model (it is shown to every user beside the
    references a spec accepts, so it must not read as one), else None: no control or format
    character (NUL, newline, a right-to-left override: Unicode categories C*), no '/', '\\' or
    ':' (a path, a hub id, job:N), not starting with '.' or '~', at most 100 characters, and
    not a zoo model's name (whatever its case)."""
    import unicodedata

    from compute.contract.modelref import REAL_MODEL_NAMES, ZOO_NAMES

    accepted = ("accepted: 1-100 printable characters without '/', '\\' or ':', not starting "
                "with '.' or '~', and not a zoo model's name")
    if not label or len(label) > 100:
        return f"{len(label)} characters; {accepted}"
    odd = next((c for c in label if unicodedata.category(c).startswith("C")), None)
    if odd is not None:
        return f"holds the character U+{ord(odd):04X}; {accepted}"
    if any(c in label for c in "/\\:") or label.startswith((".", "~")):
        return f"reads as a path, a hub id or job:N; {accepted}"
    zoo = {n.lower() for n in (*ZOO_NAMES, *REAL_MODEL_NAMES)}
    try:
        zoo |= {p.name.lower() for p in Path(settings.zoo_dir).iterdir()}
    except OSError:
        pass
    if label.lower() in zoo:
        return f"is the name of a zoo model; {accepted}"
    return None


def register_local_model(settings: Any, path: str, name: str | None = None) -> dict[str, Any]:
    """Register a local HF folder (must be inside the allowed model roots) or a trained model
    (`job:N` of a succeeded train job) under a name. SpecError naming `path` otherwise. The
    stored source (the resolved path, or job:N) is usable as a job's `model`."""
    from app import auth
    from app.services import refs as resolver
    from storage import repo

    try:  # the one resolver: zoo, allowed folder, hub id, or job:N of a train job the caller may use
        ref = resolver.resolve(settings, "path", path, "model", auth.current_user(settings))
        if ref.form == "hub" or not ref.local:
            raise ValueError("path: register local folders only (hub ids are used directly)")
    except ValueError as exc:
        msg = str(exc)
        raise SpecError([{"field": "path", "message": msg.split(": ", 1)[1] if msg.startswith(("model: ", "path: ")) else msg}]) from None
    folder = Path(ref.local)
    resolved = f"job:{ref.job_id}" if ref.form == "artifact" else ref.path
    revision = ref.sha256 or ""
    info = _folder_info(folder)
    label = (name or "").strip() or (ref.label if ref.form == "artifact" else folder.name)
    problem = model_name_problem(settings, label)
    if problem:
        raise SpecError([{"field": "name", "message": f"{label[:80]!r}: {problem}"}])
    user = auth.current_user(settings)
    if settings.auth_required and not user.is_admin:
        raise auth.Forbidden("only admins register model names (they are shared by every user); "
                             "use the folder's path as the model, or ask an admin")
    with services.sessions(settings)() as s:
        old = repo.get_model(session=s, name=label)
        if old is not None and old.source != resolved:  # a name is never silently re-pointed
            raise SpecError([{"field": "name", "message": f"{label!r} is already registered for "
                              "another folder; choose another name"}])
        row = repo.register_model(
            owner_id=old.owner_id if old is not None else user.id,
            session=s, name=label, source=resolved, revision=revision,
            architecture=info.get("architecture"), n_params=info.get("n_params"),
            n_layers=info.get("n_layers"),
            info={k: info.get(k) for k in ("hidden_size", "vocab_size")},
        )
        return repo.model_dict(row)


# ---------------------------------------------------------------- downloads


def stats_csv(result: dict[str, Any]) -> str:
    headers, rows = plots.layer_stats_table(result)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(headers)
    for r in rows:
        w.writerow(["" if v is None else v for v in r])
    return buf.getvalue()


def stats_json(result: dict[str, Any]) -> dict[str, Any]:
    return {k: result.get(k) for k in ("job", "kind", "summary", "layer_stats", "heatmaps", "series")}


def _download_name(result: dict[str, Any], suffix: str) -> str:
    job = result.get("job") or {}
    return f"fisherlens-{job.get('kind', 'job')}-{job.get('id', '')}-{suffix}"


# ---------------------------------------------------------------- router


def make_router(settings: Any) -> APIRouter:
    """All /api routes for `settings` (no module-level state: each app has its own router)."""
    r = APIRouter(prefix="/api", responses=responses(401, 403, 422, 500))
    _add_job_routes(r, settings)
    _add_result_routes(r, settings)
    _add_model_routes(r, settings)
    return r


def _result_or_404(settings: Any, token: str) -> dict[str, Any]:
    res = services.result_by_token(settings, token)
    if res is None:
        raise _not_found(f"token: no result with share token {token!r}")
    return services.without_error(res)  # the traceback is operator-only


def _add_job_routes(r: APIRouter, settings: Any) -> None:
    """/jobs: submit, list, get, cancel, rerun (one route group: five short route functions)."""

    @r.post("/jobs", status_code=201, tags=["jobs"], summary="Submit a job",
            responses=responses(413, 429, 503))
    def submit_job(req: JobRequest) -> Any:
        """Validate and queue a job (or return the stored result of an identical one:
        `reused: true`). 422 names each bad field and its accepted range; nothing is queued. A
        job estimated above the confirmation threshold is answered 422 with field `confirm` (its
        `seconds` and the threshold `limit`) until resent with `"confirm": true`; one whose
        predicted peak memory does not fit the worker's device, 422 with field `memory`."""
        try:
            job = services.submit(settings, req.kind, req.spec, confirm=req.confirm)
        except SpecError as exc:
            return spec_error_response(exc)
        except RuntimeError as exc:  # the broker or the artifact store away: a short message
            raise HTTPException(status_code=503, detail=str(exc), headers=RETRY_503) from None
        return services.without_error(job)

    @r.get("/jobs", tags=["jobs"], summary="List jobs, newest first")
    def list_jobs(
        kind: JobKind | None = Query(None, description="only jobs of this kind"),
        status: JobStatus | None = Query(None, description="only jobs in this state"),
        limit: int = Query(100, ge=1, le=1000),
        owner: str | None = Query(None, max_length=64,
                                  description="admins: one user's jobs (a name, or 'me'); default: "
                                  "everyone's. Others always get their own jobs"),
    ) -> Any:
        if kind is not None and kind not in KIND_NAMES:
            return spec_error_response(SpecError([{"field": "kind", "message": f"got {kind!r}; accepted: {', '.join(KIND_NAMES)}"}]))
        if status is not None and status not in JOB_STATUSES:
            return spec_error_response(SpecError([{"field": "status", "message": f"got {status!r}; accepted: {', '.join(JOB_STATUSES)}"}]))
        return services.without_error(
            services.list_jobs(settings, limit=limit, kind=kind, status=status, owner=owner))

    @r.get("/jobs/{job_id}", tags=["jobs"], summary="One job: status, progress, message",
           responses=responses(404))
    def get_job(job_id: int) -> Any:
        job = services.get_job(settings, job_id)
        if job is None:
            raise _not_found(f"job: no job with id {job_id}")
        return services.without_error(job)

    @r.post("/jobs/{job_id}/cancel", tags=["jobs"], summary="Cancel a queued or running job",
            responses=responses(404))
    def cancel_job(job_id: int) -> Any:
        try:
            return services.without_error(services.cancel(settings, job_id))
        except LookupError:
            raise _not_found(f"job: no job with id {job_id}") from None

    @r.post("/jobs/{job_id}/rerun", status_code=201, tags=["jobs"],
            summary="Run a finished job's spec again (a new job, computed again)",
            responses=responses(404, 409, 429, 503))
    def rerun_job(job_id: int) -> Any:
        try:
            return services.without_error(services.rerun(settings, job_id))
        except LookupError:
            raise _not_found(f"job: no job with id {job_id}") from None
        except SpecError as exc:
            return spec_error_response(exc)
        except ValueError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except RuntimeError as exc:  # the broker or the artifact store away: a short message
            raise HTTPException(status_code=503, detail=str(exc), headers=RETRY_503) from None


def _add_result_routes(r: APIRouter, settings: Any) -> None:
    """/results/{token}: the result, its statistics (CSV, JSON) and artifact downloads."""

    def result_or_404(token: str) -> dict[str, Any]:
        return _result_or_404(settings, token)

    @r.get("/results/{token}", tags=["results"], summary="A stored result (JSON) by share token",
           responses=responses(404))
    def get_result(token: str) -> Any:
        return result_or_404(token)

    @r.get("/results/{token}/stats.csv", tags=["results"], summary="Per-parameter statistics as CSV",
           responses={**responses(404), 200: {"content": {"text/csv": {}}}})
    def get_stats_csv(token: str) -> Response:
        res = result_or_404(token)
        return Response(stats_csv(res), media_type="text/csv", headers={
            "Content-Disposition": f'attachment; filename="{_download_name(res, "stats.csv")}"'})

    @r.get("/results/{token}/stats.json", tags=["results"], summary="All statistics as JSON",
           responses=responses(404))
    def get_stats_json(token: str) -> Response:
        res = result_or_404(token)
        return Response(json.dumps(stats_json(res), indent=1, default=str), media_type="application/json",
                        headers={"Content-Disposition":
                                 f'attachment; filename="{_download_name(res, "stats.json")}"'})

    @r.get("/results/{token}/artifacts/{kind}", tags=["results"],
           summary="Download an artifact (safetensors; folders as .zip)",
           responses={**responses(404, 409, 410, 503),
                      200: {"content": {"application/octet-stream": {}, "application/zip": {}}},
                      307: {"description": "ARTIFACT_DOWNLOAD_REDIRECT: a short-lived presigned "
                            "object-store URL of the file"}})
    def get_artifact(token: str, kind: str) -> Any:
        res = result_or_404(token)
        from storage.artifacts import ArtifactError, ArtifactStoreUnavailable

        try:
            url = services.artifact_url(settings, token, kind,
                                        _download_name(res, f"{kind}.safetensors"))
            if url is not None:
                return RedirectResponse(url, status_code=307, headers={"Cache-Control": "no-store"})
            path = services.artifact_path(settings, token, kind)
        except ArtifactStoreUnavailable:
            raise HTTPException(status_code=503, detail=f"artifact {kind}: the artifact store cannot "
                                "be reached right now; try again later", headers=RETRY_503) from None
        except FileNotFoundError:
            raise HTTPException(status_code=410, detail=f"artifact {kind}: no longer in the artifact "
                                "store (deleted); re-run the job to make it again") from None
        except ArtifactError:
            raise HTTPException(status_code=409, detail=f"artifact {kind}: the stored file does not "
                                "match its recorded sha256 (corrupt); re-run the job") from None
        if path is None:
            kinds = ", ".join(a["kind"] for a in res.get("artifacts") or []) or "none"
            raise _not_found(f"artifact: this result has no {kind!r} artifact; it has: {kinds}")
        from storage.artifacts import open_store

        store = open_store(settings)  # an object store's cached copy: evictable once sent
        if path.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix="fl-zip-"))
            try:
                archive = shutil.make_archive(str(tmp / kind), "zip", root_dir=path)
            finally:
                store.release(path)
            return FileResponse(archive, media_type="application/zip",
                                filename=_download_name(res, f"{kind}.zip"),
                                background=BackgroundTask(shutil.rmtree, tmp, ignore_errors=True))
        return FileResponse(path, media_type="application/octet-stream",
                            filename=_download_name(res, path.name),
                            background=BackgroundTask(store.release, path))


def _add_model_routes(r: APIRouter, settings: Any) -> None:
    """/models (list, register), /workers and /health."""

    @r.get("/models", tags=["models"], summary="Zoo, registered and trained (job:N) models")
    def list_models() -> Any:
        return all_models(settings)

    @r.post("/models", status_code=201, tags=["models"],
            summary="Register a local HF model folder (inside the allowed roots only)",
            responses=responses(413))
    def register_model(req: RegisterModel) -> Any:
        try:
            return register_local_model(settings, req.path, req.name)
        except SpecError as exc:
            return spec_error_response(exc)

    @r.get("/workers", tags=["meta"],
           summary="The live workers' devices, and what a queued job is checked against and priced by")
    def list_workers() -> Any:
        return services.workers(settings)

    @r.get("/health", tags=["meta"], include_in_schema=False)
    def health(request: Request) -> Any:
        """{"ok", "database", "broker"}: each "ok" or "unreachable"; 503 when one is missing."""
        out = services.health(settings)
        return JSONResponse(status_code=200 if out["ok"] else 503, content=out)
