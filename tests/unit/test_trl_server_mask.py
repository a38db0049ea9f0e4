"""FisherMaskCallback("job:N", server=..., token=...): the mask of a real mask job, downloaded from
a running fisherlens app (uvicorn in a thread, AUTH_REQUIRED, SQLite) through its REST API,
sha256-verified and cached (compute/integrations/server_mask.py), then used by TRL's real
SFTTrainer: every frozen coordinate is bit-identical after AdamW with weight decay, some
trainable ones moved.

The jobs are real: alice's Fisher job and her mask job (5% of that Fisher) are computed in this
process by the worker's own function (compute.worker.execute.execute_job). Refused, each naming
the job and the HTTP status or the network error: a job that is not a mask job, one that has not
succeeded, another user's job (404, as if it did not exist), no token (401), a server that cannot
be reached, and no server at all. Without arguments or FISHERLENS_URL / FISHERLENS_TOKEN, the
server and token `fisherlens login` saved (the token only for that server).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from safetensors.torch import load_file  # noqa: E402

from tests.browser import free_port  # noqa: E402
from tests.live_app import LiveApp as App  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app(zoo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    a = App(zoo_home, tmp_path_factory.mktemp("server_mask_home"))
    try:
        yield a
    finally:
        a.stop()


@pytest.fixture(scope="module")
def jobs(app: App) -> dict[str, dict[str, Any]]:
    fisher = app.submit("alice", "fisher", {"model": "arith-base", "prompts": 4, "samples": 1,
                                            "max_new_tokens": 4, "device": "cpu"})
    mask = app.submit("alice", "mask", {"fisher": f"job:{fisher['id']}", "density": 0.05})
    queued = app.submit("alice", "mask", {"fisher": f"job:{fisher['id']}", "density": 0.2}, run=False)
    return {"fisher": fisher, "mask": mask, "queued": queued}


def _stored_mask(app: App, job: dict[str, Any]) -> tuple[Path, str]:
    """The stored mask file and its sha256, read as its owner (share links are off by default on
    a server with accounts: the owner reads her result by its token all the same)."""
    from app import auth, services

    with auth.acting_as(auth.token_principal(app.settings, app.tokens["alice"])):
        result = services.result_by_token(app.settings, job["share_token"])
        assert result is not None
        (art,) = [a for a in result["artifacts"] if a["kind"] == "mask"]
        path = services.artifact_path(app.settings, job["share_token"], "mask")
    assert path is not None
    return Path(path), art["sha256"]


def test_sft_trainer_with_the_mask_of_a_server_job(app: App, jobs, zoo_home: Path, tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from compute.integrations.trl import FisherMaskCallback

    m = jobs["mask"]["id"]
    cache = tmp_path / "cache"
    cb = FisherMaskCallback(f"job:{m}", server=app.url, token=app.tokens["alice"], cache_dir=cache)
    stored, sha = _stored_mask(app, jobs["mask"])
    assert cb.source == f"job:{m}" and cb.mask_file == cache / f"{sha}.safetensors"
    assert cb.mask_file.read_bytes() == stored.read_bytes()  # the job's artifact, byte for byte
    want = load_file(str(stored))
    assert set(cb.mask) == set(want) and all(torch.equal(cb.mask[n], want[n].bool()) for n in want)

    path = zoo_home / "zoo" / "arith-base"
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                     learning_rate=3e-2, weight_decay=0.1, logging_steps=1, save_strategy="no",
                     report_to="none", use_cpu=True, seed=0)
    ds = Dataset.from_list([{"prompt": f"{i}+{i + 3}=", "completion": f"{2 * i + 3}"} for i in range(16)])
    SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[cb]).train()
    moved = 0
    for n, p in model.named_parameters():
        frozen = ~cb.masks[n] if cb.masks[n] is not None else torch.zeros_like(p, dtype=torch.bool)
        w = p.detach()
        assert torch.equal(w.view(torch.int32)[frozen], before[n].view(torch.int32)[frozen]), n
        moved += int((w != before[n]).sum())
    assert moved > 0 and moved <= sum(int(x.sum()) for x in want.values())

    # cached: a second callback reads the same file; a corrupted cache entry is downloaded again
    again = FisherMaskCallback(f"job:{m}", server=app.url, token=app.tokens["alice"], cache_dir=cache)
    assert again.mask_file == cb.mask_file
    cb.mask_file.write_bytes(b"not a mask")
    fixed = FisherMaskCallback(f"job:{m}", server=app.url, token=app.tokens["alice"], cache_dir=cache)
    assert fixed.mask_file.read_bytes() == stored.read_bytes()


def test_server_and_token_from_the_environment(app: App, jobs, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from compute.integrations.trl import FisherMaskCallback

    monkeypatch.setenv("FISHERLENS_URL", app.url)
    monkeypatch.setenv("FISHERLENS_TOKEN", app.tokens["alice"])
    monkeypatch.setenv("FISHERLENS_CACHE", str(tmp_path / "envcache"))
    cb = FisherMaskCallback(f"job:{jobs['mask']['id']}")
    _, sha = _stored_mask(app, jobs["mask"])
    assert cb.mask_file == tmp_path / "envcache" / "masks" / f"{sha}.safetensors"


def test_server_and_token_saved_by_fisherlens_login(app: App, jobs, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither argument nor environment: the server and token the real `fisherlens login` saved
    (checked against the running app). The saved token goes only to the saved server: the same
    app under another address gets no token (HTTP 401). A training process fetching the mask
    this way imports no app, storage, database or web module."""
    import json
    import os
    import subprocess
    import sys

    from click.testing import CliRunner

    from app.cli import main
    from compute.integrations.trl import FisherMaskCallback

    creds = tmp_path / "cfg" / "credentials.json"
    monkeypatch.setenv("FISHERLENS_CREDENTIALS", str(creds))
    monkeypatch.delenv("FISHERLENS_URL", raising=False)
    monkeypatch.delenv("FISHERLENS_TOKEN", raising=False)
    res = CliRunner().invoke(main, ["login", "--url", app.url, "--token", app.tokens["alice"]])
    assert res.exit_code == 0, res.output
    assert json.loads(creds.read_text())["url"] == app.url and creds.stat().st_mode & 0o077 == 0

    m = jobs["mask"]["id"]
    stored, sha = _stored_mask(app, jobs["mask"])
    cb = FisherMaskCallback(f"job:{m}", cache_dir=tmp_path / "cache")
    assert cb.source == f"job:{m}" and cb.mask_file.read_bytes() == stored.read_bytes()
    assert cb.mask_file == tmp_path / "cache" / f"{sha}.safetensors"
    # the saved URL with an explicit server= equal to it: the saved token too
    assert FisherMaskCallback(f"job:{m}", server=app.url + "/", cache_dir=tmp_path / "cache").mask_file == cb.mask_file
    # another address of the same server: the saved token is not sent
    other = app.url.replace("127.0.0.1", "localhost")
    with pytest.raises(ValueError) as exc:
        FisherMaskCallback(f"job:{m}", server=other, cache_dir=tmp_path / "c2")
    assert "HTTP 401" in str(exc.value) and other in str(exc.value) and "fisherlens login" in str(exc.value)
    # an explicit token still wins over the saved one (bob's: alice's job is not his)
    with pytest.raises(ValueError, match="HTTP 404"):
        FisherMaskCallback(f"job:{m}", token=app.tokens["bob"], cache_dir=tmp_path / "c2")

    code = ("import sys, json; from compute.integrations.server_mask import fetch_mask; "
            f"p = fetch_mask('job:{m}', cache_dir={str(tmp_path / 'sub')!r}); "
            "print(json.dumps([str(p), sorted(n for n in sys.modules if n.split('.')[0] in "
            "('app', 'storage', 'gradio', 'sqlalchemy', 'celery', 'redis', 'fastapi', 'uvicorn'))]))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    path, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(path).read_bytes() == stored.read_bytes() and heavy == []


def test_refusals_name_the_job_and_the_status(app: App, jobs, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from compute.integrations.trl import FisherMaskCallback

    monkeypatch.delenv("FISHERLENS_URL", raising=False)
    monkeypatch.delenv("FISHERLENS_TOKEN", raising=False)
    monkeypatch.setenv("FISHERLENS_CREDENTIALS", str(tmp_path / "none.json"))  # no `fisherlens login` either
    alice, m = app.tokens["alice"], jobs["mask"]["id"]
    f, q = jobs["fisher"]["id"], jobs["queued"]["id"]

    def refused(ref: str, **kw: Any) -> str:
        with pytest.raises(ValueError) as exc:
            FisherMaskCallback(ref, cache_dir=tmp_path / "c", **kw)
        return str(exc.value)

    msg = refused(f"job:{f}", server=app.url, token=alice)
    assert f"mask job:{f}" in msg and "is a fisher job" in msg
    msg = refused(f"job:{q}", server=app.url, token=alice)
    assert f"job {q} is queued" in msg and "succeeded" in msg
    msg = refused(f"job:{m}", server=app.url, token=app.tokens["bob"])  # alice's job, bob's token
    assert f"mask job:{m}" in msg and "HTTP 404" in msg and "another user" in msg
    assert refused("job:999999", server=app.url, token=alice).replace("999999", str(m)) == msg
    msg = refused(f"job:{m}", server=app.url)  # no token
    assert "HTTP 401" in msg and "FISHERLENS_TOKEN" in msg
    dead = f"http://127.0.0.1:{free_port()}"
    msg = refused(f"job:{m}", server=dead, token=alice)
    assert f"mask job:{m}" in msg and dead in msg and "cannot be reached" in msg
    assert "FISHERLENS_URL" in refused(f"job:{m}")  # no server at all
    assert "not a job reference" in refused("job:x1", server=app.url)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())  # nothing cached
