"""Deployment rules and the cost model, without a server: an open bind needs accounts (or an
explicit flag), the compose file runs the shared server with accounts, and parameter counts and
token passes by hand (app/limits.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compute.contract.settings import Settings


def test_binding_beyond_loopback_needs_accounts_or_an_explicit_flag() -> None:
    from app.auth import check_bind, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    open_settings = Settings(auth_required=False)
    check_bind("127.0.0.1", open_settings)
    with pytest.raises(SystemExit, match="AUTH_REQUIRED=true"):
        check_bind("0.0.0.0", open_settings)
    check_bind("0.0.0.0", Settings(auth_required=True))
    check_bind("0.0.0.0", Settings(allow_open_bind=True))


def test_compose_runs_the_shared_server_with_accounts() -> None:
    import yaml

    root = Path(__file__).resolve().parents[2]
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    app = compose["services"]["app"]
    assert app["environment"]["AUTH_REQUIRED"] == "true"
    assert Settings(auth_required=app["environment"]["AUTH_REQUIRED"]).auth_required is True
    # the health check must not need a user (it would never turn healthy)
    assert "/api/health" in " ".join(app["healthcheck"]["test"])


# ---------------------------------------------------------------- cost model by hand


def test_parameter_count_from_safetensors_headers(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from app.limits import count_params

    d = tmp_path / "m"
    d.mkdir()
    save_file({"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float16)},
              str(d / "model-00001-of-00002.safetensors"))
    save_file({"c": np.zeros((2, 2, 2), np.float32)}, str(d / "model-00002-of-00002.safetensors"))
    assert count_params(d) == 12 + 5 + 8
    (d / "fisherlens.json").write_text(json.dumps({"params": 7}))  # the zoo's own count wins
    assert count_params(d) == 7
    empty = tmp_path / "e"
    empty.mkdir()
    assert count_params(empty) is None  # unknown, never zero


def test_token_passes_by_hand() -> None:
    from app.limits import token_passes
    from compute.jobs.registry import parse_spec

    length = 64 + 6  # assumed prompt + max_new_tokens
    base = {"model": "m", "steps": 10, "batch": 4, "group": 2, "max_new_tokens": 6, "eval_prompts": 5}
    grpo = parse_spec("train", {**base, "bound": False, "concentration": False})
    # per step 4 x 2 sequences: sampling 1 + gradient 3 passes; greedy eval before and after
    runs = 10 * 4 * 2 * length * 4 + 2 * 5 * length
    assert token_passes("train", grpo) == runs
    # the bound check adds an independent Fisher (32 x 4 samples) and one backward per sample
    # of the first batch
    checked = parse_spec("train", {**base, "bound": True})
    assert token_passes("train", checked) == runs + 32 * 4 * length * 4 + 4 * 2 * length * 3
    sft = parse_spec("train", {"model": "m", "algo": "sft", "steps": 10, "batch": 4,
                               "max_new_tokens": 6, "eval_prompts": 5, "concentration": False})
    assert token_passes("train", sft) == 10 * 4 * length * 3 + 2 * 5 * length
    ret = parse_spec("retention", {"densities": [0.1, 0.2], "selectors": ["fisher"], "seeds": 2,
                                   "steps": 3, "batch": 2, "group": 2, "max_new_tokens": 4,
                                   "eval_prompts": 7, "fisher_prompts": 3, "fisher_samples": 1})
    length = 64 + 4
    one_run = 3 * 2 * 2 * length * 4 + 2 * 7 * length
    fisher = 3 * 1 * length * (1 + 3)  # sampling + gradient, no exact output layer
    assert token_passes("retention", ret) == 2 * (2 * 1 + 1) * one_run + 2 * fisher
    tok = parse_spec("tokens", {"model": "m", "context": "12+34=", "top_k": 2, "random_k": 0,
                                "low_k": 0, "max_tokens": 3})
    assert token_passes("tokens", tok) == 6 * (1 + 3 * (2 + 3))
    with pytest.raises(ValueError, match="accepted: fisher, mask, train"):  # never an unknown cost
        token_passes("no-such-kind", tok)
