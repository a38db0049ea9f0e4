"""Deployment settings: one pydantic-settings class, read from env vars and `.env`.

Experiment knobs do not live here; they live in the per-algorithm config dataclasses in
`compute/` and in the job specs (`compute/contract/specs.py`).
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    fisherlens_home: Path = Field(
        default=Path(".fisherlens"),
        description="Folder for the embedded SQLite database, the filesystem queue, artifacts and the zoo.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db. Default: SQLite under FISHERLENS_HOME.",
    )
    redis_url: str | None = Field(
        default=None,
        description="Celery broker, e.g. redis://redis:6379/0. Default: kombu filesystem:// under FISHERLENS_HOME.",
    )
    artifact_root: Path | None = Field(
        default=None, description="Where safetensors artifacts go. Default: FISHERLENS_HOME/artifacts."
    )
    # -- the artifact store (storage/artifacts.py: open_store) -------------------------------
    artifact_url: str | None = Field(
        default=None,
        description="S3-compatible object storage for artifacts, s3://BUCKET/PREFIX (workers on "
        "several machines share nothing but the database, the broker and this store). Endpoint "
        "and credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_DEFAULT_REGION (or boto3's usual config). Default: the local folder ARTIFACT_ROOT.",
    )
    aws_endpoint_url: str | None = Field(
        default=None, description="S3 endpoint of MinIO or another S3-compatible server "
        "(e.g. http://minio:9000); unset for AWS S3."
    )
    aws_access_key_id: str | None = Field(default=None, description="S3 access key id.")
    aws_secret_access_key: SecretStr | None = Field(default=None, description="S3 secret key.")
    aws_default_region: str | None = Field(default=None, description="S3 region (e.g. us-east-1).")
    artifact_cache_dir: Path | None = Field(
        default=None,
        description="Local cache of artifacts read from object storage, keyed by sha256. "
        "Default: FISHERLENS_HOME/artifact-cache.",
    )
    artifact_cache_max_bytes: int = Field(
        default=20 * 2**30,
        ge=0,
        description="Size cap of the artifact cache (bytes); least recently used entries are "
        "evicted past it (entries in use by a running job are kept).",
    )
    artifact_upload_retry_s: float = Field(
        default=900.0,
        ge=0,
        description="A worker whose upload to the object store fails keeps the computed result "
        "and retries the upload (backing off) this long before failing the job.",
    )
    artifact_download_redirect: bool = Field(
        default=False,
        description="Downloads of single-file artifacts redirect to a presigned object-store URL "
        "(valid ARTIFACT_PRESIGN_S) instead of streaming through the web; only when users' "
        "browsers can reach AWS_ENDPOINT_URL.",
    )
    artifact_presign_s: int = Field(
        default=300, ge=10, le=7 * 24 * 3600, description="Lifetime of presigned download URLs (s)."
    )
    allowed_model_roots: str = Field(
        default="",
        description="Colon-separated folders from which local HF model directories may be registered/loaded.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Operator opt-in for transformers' trust_remote_code: off, a model whose "
        "config.json names its own code (auto_map) is refused at submit, and the one loader "
        "(compute.lm.causal_lm.load_model) never runs model code.",
    )
    hf_hub_offline: bool = Field(
        default=False,
        description="HF_HUB_OFFLINE: hub models only from the local cache (1/true/yes/on).",
    )
    transformers_offline: bool = Field(
        default=False, description="TRANSFORMERS_OFFLINE: the same switch, transformers' name."
    )
    public_url: str = Field(
        default="http://127.0.0.1:7860", description="Base URL used when printing share links."
    )
    host: str = "127.0.0.1"
    port: int = 7860
    job_visibility_timeout_s: int = Field(
        default=6 * 3600, description="Broker visibility timeout; must exceed the longest job."
    )
    job_stale_after_s: int = Field(
        default=300,
        description="A running job whose worker heartbeat is older than this is considered lost.",
    )
    reconcile_interval_s: float = Field(
        default=30.0,
        gt=0,
        description="Every worker reconciles jobs with the broker at start-up and then this often: "
        "re-sends lost messages, finishes interrupted shard fan-outs, re-queues or fails the jobs "
        "of dead workers.",
    )
    reconcile_queued_after_s: float = Field(
        default=60.0,
        gt=0,
        description="A job `queued` this long whose message is in no queue (nor held by a "
        "consumer for less than this) is re-sent by the reconciler.",
    )

    # -- worker processes (compute/worker/, compute/runtime/celery_app.py, compute/lm/device.py) ----------
    fisherlens_queue: str = Field(
        default="fisherlens",
        description="FISHERLENS_QUEUE: the broker queue of every job kind; separates stacks "
        "sharing one Redis (and tests).",
    )
    fisherlens_max_attempts: int = Field(
        default=2, ge=1,
        description="FISHERLENS_MAX_ATTEMPTS: starts of a job whose worker died before it gives "
        "up (2: a lost job is re-run once).",
    )
    fisherlens_worker_name: str | None = Field(
        default=None,
        description="FISHERLENS_WORKER_NAME: this worker's name in job rows; unset: "
        "<prefix>-<pid>@<host>.",
    )
    fisherlens_device: str | None = Field(
        default=None,
        description="FISHERLENS_DEVICE: what device 'auto' means (cpu, cuda, cuda:N); unset: "
        "cuda when available, else cpu.",
    )

    # -- accounts and limits (app/auth/, app/limits.py) -------------------------------------
    auth_required: bool = Field(
        default=False,
        description="Shared-server mode: every API call and UI page except share links and "
        "health needs a signed-in user (bearer token or browser session). Off: single-user "
        "embedded mode, everything runs as the user 'local'.",
    )
    allow_open_bind: bool = Field(
        default=False,
        description="Let the app listen on a non-loopback address without AUTH_REQUIRED "
        "(anyone who can reach it can then run and cancel jobs). Off: it refuses to start.",
    )
    session_max_age_s: int = Field(
        default=7 * 24 * 3600, ge=60, description="Browser sign-in lifetime (seconds)."
    )
    max_active_jobs: int | None = Field(
        default=4, ge=1, description="Queued + running jobs per user (HTTP 429 past it)."
    )
    max_active_jobs_admin: int | None = Field(
        default=None, ge=1, description="The same for admins and the local user (none: no limit)."
    )
    max_job_cost: float | None = Field(
        default=None,
        gt=0,
        description="Per-job ceiling on the estimated cost (parameter-token-passes, see "
        "app/limits.py) for users (HTTP 422 past it). Default: none, the time ceiling "
        "MAX_JOB_SECONDS applies.",
    )
    max_job_seconds: float | None = Field(
        default=2 * 3600,
        gt=0,
        description="Per-job ceiling on the estimated run time for users (HTTP 422 past it), "
        "turned into a cost ceiling with the measured THROUGHPUT (app/limits.py).",
    )
    max_job_seconds_admin: float | None = Field(
        default=None, gt=0, description="The same for admins and the local user (none: no limit)."
    )
    throughput: float | None = Field(
        default=None,
        gt=0,
        description="Parameter-token-passes per second a worker sustains. Default: read from "
        "THROUGHPUT_FILE (benchmarks/bench_throughput.py writes it).",
    )
    throughput_file: Path | None = Field(
        default=None,
        description="JSON of the cost model: `fisherlens calibrate` (a + b x params per token-pass, "
        "measured on this machine) or benchmarks/bench_throughput.py. Default: "
        "FISHERLENS_HOME/throughput.json, else the committed benchmarks/results/throughput.json.",
    )
    calibrate_on_up: bool = Field(
        default=True,
        description="A worker measures its device's cost model (`fisherlens calibrate`) at start "
        "when FISHERLENS_HOME has no throughput.json measured on that kind of device, and "
        "`fisherlens up --no-worker` in the background when it has none.",
    )
    max_job_cost_admin: float | None = Field(
        default=None, gt=0, description="The same for admins and the local user (none: no limit)."
    )
    confirm_above_s: float | None = Field(
        default=3600,
        ge=0,
        description="Jobs whose estimated run time is above this many seconds need a confirmation: "
        "the API answers 422 (field `confirm`) unless the request has \"confirm\": true, the CLI "
        "asks (or takes --yes), the form shows a checkbox. None or 0: never ask.",
    )
    max_job_memory_mb: float | None = Field(
        default=None,
        gt=0,
        description="Memory (MiB) a job may use on the worker's device, checked at submit against "
        "the estimated peak (HTTP 422, field `memory`) and kept to by the running job (its "
        "automatic temporaries budget and GRPO's bound-check groups are sized within it). Default: "
        "what the device has free now (CPU: MemAvailable of /proc/meminfo; CUDA: "
        "torch.cuda.mem_get_info).",
    )
    share_by_default: bool | None = Field(
        default=None,
        description="Whether a new job's share link works from the start. Default: on in the "
        "embedded mode, off with AUTH_REQUIRED (the owner turns a link on).",
    )
    signin_throttle: str = Field(
        default="5/minute;10/10 minutes;20/hour;50/day",
        description="Failed sign-ins allowed per account and per client address, as stacked "
        "windows (the `limits` notation): past one, HTTP 429 + Retry-After until it ends.",
    )
    token_throttle: str = Field(
        default="30/minute;300/hour",
        description="Bad bearer tokens / session cookies allowed per client address (windows).",
    )
    token_cache_s: float = Field(
        default=10.0,
        ge=0,
        le=300,
        description="PostgreSQL: seconds a web process remembers a verified bearer token or "
        "session (dropped at once on any revoke, sign-out, password change or user change, "
        "through LISTEN/NOTIFY; nothing is cached while that connection is down). 0: look "
        "every token up on every request.",
    )
    signin_threads: int = Field(
        default=2, ge=1, description="Password hashes (argon2) verified at once by one web process."
    )
    signin_backlog: int = Field(
        default=32, ge=1, description="Sign-ins waiting for a hashing thread before HTTP 429."
    )
    allowed_hosts: str = Field(
        default="",
        description="Embedded mode: comma-separated Host names the server answers besides the "
        "loopback names and PUBLIC_URL's host (DNS-rebinding guard).",
    )
    max_body_bytes: int = Field(
        default=1_000_000, ge=1024, description="Largest request body accepted (HTTP 413 past it)."
    )
    max_spec_keys: int = Field(default=64, ge=1, description="Most keys in a job spec.")
    max_spec_string: int = Field(
        default=4096, ge=16, description="Longest string value in a job spec (characters)."
    )

    @field_validator("artifact_url")
    @classmethod
    def _s3_url(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        v = v.strip()
        m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/[A-Za-z0-9_.\-/]*)?", v)
        if not m or ".." in v:
            raise ValueError(
                f"ARTIFACT_URL: {v!r} is not an object-store URL; accepted: s3://BUCKET or "
                "s3://BUCKET/PREFIX (bucket: 3-63 lower-case letters, digits, '.', '-'; prefix: "
                "letters, digits, '_', '.', '-', '/'); unset it for the local folder ARTIFACT_ROOT"
            )
        return v.rstrip("/")

    @property
    def artifact_cache(self) -> Path:
        return (self.artifact_cache_dir or self.home / "artifact-cache").expanduser().resolve()

    @field_validator("hf_hub_offline", "transformers_offline", mode="before")
    @classmethod
    def _flag(cls, v: object) -> object:
        """huggingface_hub's own reading: 1/true/yes/on (any case) is on, anything else off."""
        return v.strip().lower() in ("1", "true", "yes", "on") if isinstance(v, str) else v

    @property
    def offline(self) -> bool:
        """No network for the hub: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE (parsed here only)."""
        return self.hf_hub_offline or self.transformers_offline

    @property
    def home(self) -> Path:
        return self.fisherlens_home.expanduser().resolve()

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'fisherlens.db'}"

    @property
    def artifacts_dir(self) -> Path:
        return (self.artifact_root or self.home / "artifacts").expanduser().resolve()

    @property
    def zoo_dir(self) -> Path:
        return self.home / "zoo"

    @property
    def queue_dir(self) -> Path:
        return self.home / "queue"

    @cached_property
    def model_roots(self) -> list[Path]:
        roots = [self.zoo_dir]
        roots += [Path(p).expanduser().resolve() for p in self.allowed_model_roots.split(":") if p]
        return roots


def get_settings() -> Settings:
    """A fresh Settings each call, so tests can change env vars between calls."""
    return Settings()
