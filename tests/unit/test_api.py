"""REST API routes against a real SQLite database and the real filesystem queue (no worker:
queued jobs stay queued; results are written with storage's save_result)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from compute.contract.jobresult import Heatmap, JobResult, LayerStat, SeriesPoint
from compute.contract.settings import Settings
from tests.pg import pg_schema_url


def _hf_folder(path: Path, layers: int = 2) -> Path:
    """A minimal HF-format folder: enough for model references and revisions (no weights loaded)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": layers,
        "hidden_size": 32, "vocab_size": 20}))
    # one F32 tensor, a valid safetensors file (submit validates headers); never loaded here
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("api_home")
    _hf_folder(home / "zoo" / "arith-base")
    models = tmp_path_factory.mktemp("allowed_models")
    _hf_folder(models / "my-model", layers=3)
    settings = Settings(fisherlens_home=home, database_url=None, redis_url=None,
                        allowed_model_roots=str(models), public_url="http://testserver")
    from app.web import create_app

    client = TestClient(create_app(settings), follow_redirects=False)
    return settings, client, models


def _queued_messages(settings: Settings) -> int:
    folder = settings.queue_dir / "messages"
    return len(list(folder.glob("*"))) if folder.is_dir() else 0


def _submit(client: TestClient, **spec) -> dict:
    r = client.post("/api/jobs", json={"kind": "fisher", "spec": {"model": "arith-base", **spec}})
    assert r.status_code == 201, r.text
    return r.json()


def test_submit_queues_a_job_and_returns_share_url(env):
    settings, client, _ = env
    before = _queued_messages(settings)
    job = _submit(client, prompts=4, samples=1, seed=101)
    assert job["status"] == "queued" and job["kind"] == "fisher"
    assert job["share_url"] == f"http://testserver/r/{job['share_token']}"
    assert len(job["share_token"]) >= 22  # >= 128 random bits
    assert _queued_messages(settings) == before + 1  # sent by name to the filesystem broker
    got = client.get(f"/api/jobs/{job['id']}").json()
    assert got["status"] == "queued" and got["spec"]["prompts"] == 4 and got["spec"]["seed"] == 101
    listed = client.get("/api/jobs", params={"kind": "fisher"}).json()
    assert job["id"] in [j["id"] for j in listed]


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"kind": "fisher", "spec": {"model": "arith-base", "prompts": 0}}, "prompts", ">= 1, <= 4096"),
        ({"kind": "fisher", "spec": {"model": "arith-base", "temperature": 9}}, "temperature", "<= 5.0"),
        ({"kind": "fisher", "spec": {"model": "arith-base", "estimator": "magic"}}, "estimator", "sequence"),
        ({"kind": "fisher", "spec": {"model": "arith-base", "bogus": 1}}, "bogus", "unknown field"),
        ({"kind": "fisher", "spec": {"model": "no-such-model"}}, "model", "unknown model"),
        ({"kind": "fisher", "spec": {"model": "/etc"}}, "model", "outside the allowed model roots"),
        ({"kind": "nope", "spec": {}}, "kind", "accepted: fisher"),
        ({"spec": {}}, "kind", "Field required"),
        ({"kind": "tokens", "spec": {"model": "arith-base", "context": "   "}}, "context", "non-space"),
    ],
)
def test_bad_input_is_422_naming_the_field_and_nothing_is_queued(env, body, field, words):
    settings, client, _ = env
    n_jobs = len(client.get("/api/jobs").json())
    n_msgs = _queued_messages(settings)
    r = client.post("/api/jobs", json=body)
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert any(e["field"] == field and words in e["message"] for e in errors), errors
    assert len(client.get("/api/jobs").json()) == n_jobs
    assert _queued_messages(settings) == n_msgs


def test_unknown_ids_and_tokens_are_404(env):
    _, client, _ = env
    assert client.get("/api/jobs/987654").status_code == 404
    assert "no job with id 987654" in client.get("/api/jobs/987654").json()["detail"]
    assert client.post("/api/jobs/987654/cancel").status_code == 404
    assert client.post("/api/jobs/987654/rerun").status_code == 404
    assert client.get("/api/results/not-a-token").status_code == 404
    assert client.get("/api/results/not-a-token/stats.csv").status_code == 404
    r = client.get("/r/AbCdEfGhIjKlMnOpQrStUv")
    assert r.status_code == 404 and "Result not found" in r.text and "text/html" in r.headers["content-type"]
    assert client.get("/api/jobs", params={"status": "bogus"}).status_code == 422


def test_cancel_then_rerun(env):
    _, client, _ = env
    job = _submit(client, prompts=3, seed=202)
    r = client.post(f"/api/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert client.get(f"/api/jobs/{job['id']}").json()["status"] == "cancelled"
    r = client.post(f"/api/jobs/{job['id']}/rerun")
    assert r.status_code == 201
    new = r.json()
    assert new["id"] != job["id"] and new["status"] == "queued" and new["spec"] == job["spec"]
    # a queued job cannot be re-run before it finishes: 409 with the reason
    r = client.post(f"/api/jobs/{new['id']}/rerun")
    assert r.status_code == 409 and "still queued" in r.json()["detail"]


def _store_result(settings: Settings, job_id: int) -> None:
    import torch

    from app import services
    from storage import repo
    from storage.artifacts import open_store

    result = JobResult(
        kind="fisher",
        summary={"n_samples": 4, "gini": 0.75},
        layer_stats=[
            LayerStat("model.layers.0.mlp.up_proj.weight", "up", 0, {"mean": 0.5, "mass": 2.0, "numel": 4}),
            LayerStat("model.embed_tokens.weight", "embed", None, {"mean": 0.25, "mass": 2.0, "numel": 8}),
        ],
        heatmaps=[Heatmap("fisher_mean", ["up"], ["0"], [[0.5]], {"log": True})],
        series=[SeriesPoint("concentration", 0.1, 0.6), SeriesPoint("concentration", 1.0, 1.0)],
        tensors={"fisher": {"model.layers.0.mlp.up_proj.weight": torch.arange(4.0).reshape(2, 2)}},
    )
    with services.sessions(settings)() as s:
        repo.mark_running(session=s, job_id=job_id, worker="test")
        repo.save_result(session=s, job_id=job_id, result=result, store=open_store(settings))
        repo.mark_succeeded(session=s, job_id=job_id)


def test_result_json_downloads_and_share_link(env):
    settings, client, _ = env
    job = _submit(client, prompts=5, seed=303)
    _store_result(settings, job["id"])
    token = job["share_token"]

    res = client.get(f"/api/results/{token}").json()
    assert res["job"]["status"] == "succeeded" and res["kind"] == "fisher"
    assert res["summary"] == {"n_samples": 4, "gini": 0.75}
    assert [s["param"] for s in res["layer_stats"]] == ["model.layers.0.mlp.up_proj.weight",
                                                        "model.embed_tokens.weight"]
    assert res["heatmaps"][0]["z"] == [[0.5]] and len(res["series"]) == 2
    assert [a["kind"] for a in res["artifacts"]] == ["fisher"]

    # the plot builders take the API's JSON as it is
    from app import plots

    titles = [t for t, _ in plots.result_figures(res)]
    assert titles[:2] == ["fisher_mean", "fisher_share"]

    csv_text = client.get(f"/api/results/{token}/stats.csv").text.splitlines()
    assert csv_text[0] == "group,param,layer,module,mean,mass,numel"
    assert csv_text[1] == "tensor,model.layers.0.mlp.up_proj.weight,0,up,0.5,2.0,4"
    assert csv_text[2].startswith("tensor,model.embed_tokens.weight,,embed")
    stats = client.get(f"/api/results/{token}/stats.json").json()
    assert stats["summary"]["gini"] == 0.75 and stats["job"]["id"] == job["id"]

    r = client.get(f"/api/results/{token}/artifacts/fisher")
    assert r.status_code == 200
    from safetensors.torch import load

    tensors = load(r.content)
    assert tensors["model.layers.0.mlp.up_proj.weight"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    r = client.get(f"/api/results/{token}/artifacts/mask")
    assert r.status_code == 404 and "it has: fisher" in r.json()["detail"]

    r = client.get(f"/r/{token}")  # the share page: the figures are in the HTML itself
    assert r.status_code == 200 and "id='fl-fig-0-data'" in r.text and f"/?view={token}" in r.text

    # an identical spec on the same model revision returns the stored result (no new job)
    again = _submit(client, prompts=5, seed=303)
    assert again["id"] == job["id"] and again["reused"] is True


def test_models_list_and_register_inside_allowed_roots_only(env, tmp_path):
    _, client, models = env
    names = [m["name"] for m in client.get("/api/models").json()]
    assert names[0] == "arith-base"
    zoo = client.get("/api/models").json()[0]
    assert zoo["architecture"] == "Qwen3ForCausalLM" and zoo["n_layers"] == 2

    outside = _hf_folder(tmp_path / "outside")
    r = client.post("/api/models", json={"path": str(outside)})
    assert r.status_code == 422
    assert r.json()["detail"][0]["field"] == "path"
    assert "outside the allowed model roots" in r.json()["detail"][0]["message"]

    r = client.post("/api/models", json={"path": str(models / "my-model"), "name": "mine"})
    assert r.status_code == 201, r.text
    listed = {m["name"]: m for m in client.get("/api/models").json()}
    assert listed["mine"]["n_layers"] == 3 and listed["mine"]["path"] == str((models / "my-model").resolve())


def test_pages_and_openapi(env):
    _, client, _ = env
    r = client.get("/")
    assert r.status_code == 200 and "fisherlens" in r.text
    spec = client.get("/api/openapi.json").json()
    assert {"/api/jobs", "/api/jobs/{job_id}", "/api/jobs/{job_id}/cancel",
            "/api/results/{token}"} <= set(spec["paths"])
    assert client.get("/api/docs").status_code == 200
    assert client.get("/fisherlens-static/fisherlens.css").status_code == 200


def test_web_process_does_not_import_torch(tmp_path):
    """Building the app and serving a page and a submit must not pull in torch/transformers."""
    _hf_folder(tmp_path / "zoo" / "arith-base")
    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from compute.contract.settings import Settings\n"
        "from app.web import create_app\n"
        f"s = Settings(fisherlens_home={str(tmp_path)!r}, database_url=None, redis_url=None)\n"
        "c = TestClient(create_app(s), base_url='http://127.0.0.1')\n"
        "assert c.get('/').status_code == 200\n"
        "r = c.post('/api/jobs', json={'kind': 'fisher', 'spec': {'model': 'arith-base'}})\n"
        "assert r.status_code == 201, r.text\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_ui_form_values_become_valid_specs_and_html_is_escaped():
    from app import ui
    from compute.jobs.registry import parse_spec

    forms = {
        "fisher": dict(model="arith-base", task="arithmetic", prompts=8.0, samples=2.0, estimator="sequence",
                       seed=0.0, max_new_tokens=16.0, temperature=1.0, exact_output=True),
        "mask": dict(fisher="job:1", select="random", density=0.05, model="", seed=0.0),
        "train": dict(model="arith-base", task="arithmetic", algo="grpo", teacher=None, mask="", mask_select=None,
                      mask_density=None, optimizer="adamw", lr=0.001, steps=30.0, batch=8.0, group=8.0, seed=0.0),
        "retention": dict(model="arith-base", algo="grpo", teacher=None, densities=[0.01, 0.05],
                          selectors=["fisher", "random"], seeds=3.0, steps=30.0, lr=0.001),
        "diff": dict(base="arith-base", tuned="arith-teacher", fisher="", topk_percent=1.0),
        "tokens": dict(model="arith-base", context="12+34=", top_k=8.0, layer=None, random_k=8.0),
    }
    for kind, values in forms.items():
        spec = parse_spec(kind, ui.clean_spec(values))
        assert spec is not None
    assert ui.clean_spec({"prompts": 8.0, "temperature": 1.0, "model": " m "}) == \
        {"prompts": 8, "temperature": 1.0, "model": "m"}
    assert ui._range_info("fisher", "prompts") == "accepted: >= 1, <= 4096"
    with pytest.raises(Exception, match="densities"):
        ui.parse_float_list("0.1, x", "densities")

    evil = "<script>alert(1)</script>"
    job = {"id": 1, "kind": "fisher", "status": "failed", "progress": 0.5, "message": evil, "error": evil,
           "spec": {"model": evil}, "share_token": "t", "created_at": None}
    for html_text in (ui.progress_html(job), ui.jobs_table_html([job]), ui.spec_html(job)):
        assert "<script>" not in html_text and "&lt;script&gt;" in html_text
    assert "data-status='failed'" in ui.progress_html(job)


# ---------------------------------------------------------------- hardening (issue 8)


@pytest.mark.parametrize("job_id", ["0", "-1", "2147483648", "99999999999999999999"])
def test_ids_out_of_range_are_404_not_500(env, job_id):
    """SQLite raised OverflowError and PostgreSQL NumericValueOutOfRange for 2147483648 (500)."""
    _, client, _ = env
    for method, url in (("get", f"/api/jobs/{job_id}"), ("post", f"/api/jobs/{job_id}/cancel"),
                        ("post", f"/api/jobs/{job_id}/rerun")):
        r = getattr(client, method)(url)
        assert r.status_code == 404 and r.json() == {"detail": f"job: no job with id {int(job_id)}"}, r.text


@pytest.mark.postgres
def test_ids_out_of_range_are_404_on_postgresql(tmp_path):
    with pg_schema_url() as url:
        _hf_folder(tmp_path / "zoo" / "arith-base")
        settings = Settings(fisherlens_home=tmp_path, database_url=url, redis_url=None)
        from app.web import create_app

        client = TestClient(create_app(settings), raise_server_exceptions=False, base_url="http://127.0.0.1")
        for url_ in ("/api/jobs/2147483648", "/api/jobs/2147483648/cancel", "/api/jobs/2147483648/rerun"):
            r = client.get(url_) if url_.count("/") == 3 else client.post(url_)
            assert r.status_code == 404, (url_, r.status_code, r.text)


def test_over_long_names_and_paths_are_422_without_server_paths(env):
    settings, client, models = env
    for body in ({"path": "0" * 1000}, {"path": "/" + "a" * 300}, {"path": "a" * 300},
                 {"path": str(models / "my-model"), "name": "n" * 300}):
        r = client.post("/api/models", json=body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["detail"] and {"field", "message"} <= set(r.json()["detail"][0])
    r = client.post("/api/jobs", json={"kind": "fisher", "spec": {"model": "m" * 300}})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "model"
    r = client.post("/api/jobs", json={"kind": "fisher", "spec": {"model": "/etc"}})
    text = r.text
    assert r.status_code == 422 and str(models) not in text and str(settings.zoo_dir) not in text
    r = client.post("/api/jobs", json={"kind": "mask", "spec": {"fisher": "/etc/passwd"}})
    assert r.status_code == 422 and str(settings.artifacts_dir) not in r.text


def test_corrupt_artifact_is_409_and_missing_is_410(env):
    settings, client, _ = env
    job = _submit(client, prompts=6, seed=404)
    _store_result(settings, job["id"])
    token = job["share_token"]
    art = client.get(f"/api/results/{token}").json()["artifacts"][0]
    path = settings.artifacts_dir / art["path"]
    path.write_bytes(path.read_bytes()[:-4] + b"XXXX")
    r = client.get(f"/api/results/{token}/artifacts/fisher")
    assert r.status_code == 409 and "sha256" in r.json()["detail"], r.text
    assert str(settings.artifacts_dir) not in r.text
    page = client.get(f"/r/{token}")  # the share page says so too (issue 21)
    assert page.status_code == 200 and "id='fl-artifact-warning'" in page.text
    assert "fisher artifact does not match its recorded sha256" in page.text
    path.unlink()
    r = client.get(f"/api/results/{token}/artifacts/fisher")
    assert r.status_code == 410 and "no longer in the artifact store" in r.json()["detail"], r.text


def test_failed_job_shows_one_line_cause_and_no_traceback(env):
    """The traceback stays operator-only (jobs.error, the worker log); users get one line."""
    settings, client, _ = env
    from app import services
    from storage import repo

    job = _submit(client, prompts=7, seed=505)
    trace = ("Traceback (most recent call last):\n  File \"/srv/fisherlens/compute/jobs/fisher_run.py\", "
             "line 3, in run\nValueError: fisher: cannot read /srv/data/x.safetensors as safetensors")
    with services.sessions(settings)() as s:
        repo.mark_running(session=s, job_id=job["id"], worker="w")
        repo.mark_failed(session=s, job_id=job["id"], error=trace, message=trace)
        assert repo.get_job(session=s, job_id=job["id"]).error == trace  # kept for operators
    for body in (client.get(f"/api/jobs/{job['id']}").json(),
                 client.get(f"/api/results/{job['share_token']}").json()["job"],
                 next(j for j in client.get("/api/jobs").json() if j["id"] == job["id"])):
        assert "error" not in body and body["status"] == "failed"
        assert body["message"] == "ValueError: fisher: cannot read <path> as safetensors"
    page = client.get(f"/r/{job['share_token']}").text
    assert "Traceback" not in page and "/srv/" not in page and "cannot read" in page


def test_openapi_documents_every_error_status_with_its_body(env):
    _, client, _ = env
    spec = client.get("/api/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # FastAPI's 422 shape is never sent
    assert schemas["FieldErrors"]["properties"]["detail"]["items"]["$ref"].endswith("/FieldError")
    ops = spec["paths"]
    ref = lambda op, code: op["responses"][code]["content"]["application/json"]["schema"]["$ref"]  # noqa: E731
    assert ref(ops["/api/jobs"]["post"], "422").endswith("/FieldErrors")
    assert ref(ops["/api/jobs/{job_id}"]["get"], "404").endswith("/Message")
    assert {"404", "409", "410"} <= set(ops["/api/results/{token}/artifacts/{kind}"]["get"]["responses"])
    assert {"404", "409", "503"} <= set(ops["/api/jobs/{job_id}/rerun"]["post"]["responses"])
    # and a 422 body has exactly the advertised shape
    r = client.post("/api/jobs", json={"kind": "fisher"})
    assert r.status_code == 422 and all(set(e) == {"field", "message"} for e in r.json()["detail"])


def test_openapi_job_request_is_a_union_per_kind_from_the_registry(env):
    """POST /api/jobs's body: oneOf one object per registered kind, discriminated on `kind`,
    whose `spec` is that kind's spec model (its fields, ranges and no unknown keys)."""
    from compute.jobs.registry import KINDS

    _, client, _ = env
    spec = client.get("/api/openapi.json").json()
    comps = spec["components"]["schemas"]
    body = spec["paths"]["/api/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    req = comps[body["$ref"].rsplit("/", 1)[1]]
    assert req["discriminator"]["propertyName"] == "kind"
    assert set(req["discriminator"]["mapping"]) == set(KINDS) and len(req["oneOf"]) == len(KINDS)
    for name, kind in KINDS.items():
        variant = comps[req["discriminator"]["mapping"][name].rsplit("/", 1)[1]]
        assert variant["properties"]["kind"]["enum"] == [name]
        model = comps[variant["properties"]["spec"]["$ref"].rsplit("/", 1)[1]]
        assert set(model["properties"]) == set(kind.spec.model_fields)
        assert model.get("additionalProperties") is False
    fisher = comps["FisherJobRequest"]["properties"]["spec"]["$ref"].rsplit("/", 1)[1]
    assert comps[fisher]["properties"]["prompts"].get("minimum") is not None  # ranges too


def test_api_docs_work_offline(env):
    """/api/docs loads Swagger UI from this server (the fastapi-offline package's files), not a CDN."""
    _, client, _ = env
    html = client.get("/api/docs").text
    assert "/api/docs-assets/swagger-ui-bundle.js" in html and "/api/docs-assets/swagger-ui.css" in html
    assert "cdn" not in html.lower() and "https://" not in html
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        r = client.get(f"/api/docs-assets/{asset}")
        assert r.status_code == 200 and len(r.content) > 100_000


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_undocumented_response(env):
    """A bounded, deterministic schemathesis run over every /api operation (positive and
    negative inputs): no response >= 500, every status and body as the OpenAPI schema says,
    and 405 + Allow for every method a path does not serve.
    (Schema-valid specs that name no runnable model are refused with 422 by design, so the
    positive-data-acceptance check is left out.)"""
    import schemathesis
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    settings, client, _ = env
    schema = schemathesis.openapi.from_asgi("/api/openapi.json", client.app)
    failures: list[str] = []
    calls: list[int] = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @hsettings(max_examples=25, deadline=None, database=None, derandomize=True,
                       suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call()
                calls.append(response.status_code)
                if response.status_code >= 500:
                    failures.append(f"{case.operation.label}: {response.status_code} {response.text[:200]}")
                case.validate_response(response, excluded_checks=[positive_data_acceptance])

            try:
                run()
            except Unsatisfiable:
                continue  # e.g. GET /api/models has no inputs to vary
            except BaseException as exc:  # noqa: BLE001 - schemathesis raises an ExceptionGroup
                failures.append(f"{op.label} ({mode.value}): {str(exc)[:600]}")
    assert len(calls) > 300 and not [c for c in calls if c >= 500]
    # schemathesis' unsupported_method check (its coverage phase): every method an operation's
    # path does not declare is 405 with an Allow header listing the declared ones
    spec = client.get("/api/openapi.json").json()
    every = {"get", "put", "post", "delete", "patch", "trace", "query"}  # QUERY: ST204
    for path, ops in spec["paths"].items():
        concrete = path.replace("{job_id}", "1").replace("{token}", "t").replace("{kind}", "fisher")
        for method in sorted(every - set(ops)):
            r = client.request(method.upper(), concrete)
            allow = {m.strip().lower() for m in r.headers.get("allow", "").split(",")}
            if r.status_code != 405 or not set(ops) <= allow:
                failures.append(f"{method.upper()} {path}: {r.status_code} allow={allow}")
    assert failures == []


def test_ui_refuses_fractions_for_integers_like_the_api(env):
    """gr.Number(precision=0) rounded 1.5 to 2 and queued it; now no number box rounds, and the
    value reaches the same spec validation as the API."""
    import gradio as gr

    from app import services, ui
    from compute.contract.specs import SpecError

    settings, _, _ = env
    demo = ui.build_ui(settings)
    numbers = [b for b in demo.blocks.values() if isinstance(b, gr.Number)]
    assert numbers and all(b.precision is None for b in numbers)
    with pytest.raises(SpecError) as err:
        services.submit(settings, "fisher", ui.clean_spec({"model": "arith-base", "prompts": 1.5}))
    assert err.value.errors == [{"field": "prompts", "message": "got 1.5; give a whole number"}]


def test_model_lists_offer_trained_models_as_job_refs(env, tmp_path):
    settings, client, _ = env
    from app import services
    from compute.contract.jobresult import JobResult
    from storage import repo
    from storage.artifacts import open_store

    job = client.post("/api/jobs", json={"kind": "train", "spec": {
        "model": "arith-base", "mask_select": "fisher", "mask_density": 0.1, "seed": 77}}).json()
    out = _hf_folder(tmp_path / "trained")
    with services.sessions(settings)() as s:
        repo.mark_running(session=s, job_id=job["id"], worker="w")
        repo.save_result(session=s, job_id=job["id"], result=JobResult(kind="train", summary={},
                         files={"model": str(out)}), store=open_store(settings))
        repo.mark_succeeded(session=s, job_id=job["id"])
    models = client.get("/api/models").json()
    trained = [m for m in models if m["ref"] == f"job:{job['id']}"]
    assert trained and trained[0]["name"] == f"#{job['id']} train arith-base grpo masked"
    assert models[0]["ref"] == "arith-base" and models[0]["path"] is None  # no server path
    r = client.post("/api/jobs", json={"kind": "diff", "spec": {"base": "arith-base",
                                                                "tuned": f"job:{job['id']}"}})
    assert r.status_code == 201, r.text
    # Models -> Register takes it too (a name for job:N); a queued job cannot be registered
    r = client.post("/api/models", json={"path": f"job:{job['id']}", "name": "my-trained"})
    assert r.status_code == 201 and r.json()["source"] == f"job:{job['id']}", r.text
    assert {"name": "my-trained", "ref": f"job:{job['id']}"}.items() <= next(
        m for m in client.get("/api/models").json() if m["name"] == "my-trained").items()
    r = client.post("/api/models", json={"path": "job:99999"})
    assert r.status_code == 422 and "does not exist" in r.json()["detail"][0]["message"]


def test_a_forms_cost_line_follows_its_fields_in_one_always_last_listener(env):
    """The e2e form test once read a stale estimate: a listener per field ran in parallel, and the
    reply for the first field changed (prompts, with the old samples) came back after the second
    one's. Each form's cost line now has one listener for all its fields, "always_last": the
    browser sends the next estimate only when the pending one is back, with the values of then."""
    from app import ui

    settings, _, _ = env
    demo = ui.build_ui(settings)
    costs = {b._id: b.elem_id for b in demo.blocks.values() if str(getattr(b, "elem_id", "")).endswith("-cost")}
    assert costs
    fns = list(demo.fns.values()) if isinstance(demo.fns, dict) else list(demo.fns)
    for cid, elem in costs.items():
        writers = [fn for fn in fns if [o._id for o in fn.outputs] == [cid]]
        assert len(writers) == 1, elem  # one listener writes the line (the page load writes all at once)
        (fn,) = writers
        assert fn.trigger_mode == "always_last", elem
        assert {t[0] for t in fn.targets} == {i._id for i in fn.inputs}, elem  # every field triggers it
