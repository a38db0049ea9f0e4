"""Bounded work for hostile inputs, checked at submit (issue 28, item 3), on PostgreSQL through
the real app (AUTH_REQUIRED): a config.json past sane bounds or describing another model than
its weights, safetensors headers too large, with too many tensors, bad offsets or shapes larger
than their bytes are refused with 422 naming the field (nothing queued); the cost of a mask is
its Fisher's size (it was 0) and the cost of until_reliable is its max_prompts (it was the first
round); a user's own fisherlens.json cannot shrink a model's parameter count."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.test_ref_owners_pg import Stack, _model_folder
from tests.pg import pg_schema_url

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("hostile_home")
    _model_folder(home / "zoo" / "arith-base")
    models = tmp_path_factory.mktemp("hostile_models")
    with pg_schema_url("fl_hostile") as url:
        yield Stack(home, url, models)


def _models(stack: Stack) -> Path:
    return Path(stack.settings.allowed_model_roots)


def _refused(stack: Stack, body: dict[str, Any], field: str) -> str:
    before = stack.rows()
    r = stack.client("bob").post("/api/jobs", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert [e["field"] for e in detail] == [field], detail
    assert stack.rows() == before
    return str(detail[0]["message"])


def _layered(folder: Path, layers: int, cfg: dict[str, Any]) -> Path:
    """A folder whose weights hold `layers` layers (embedding 3 x 4) and this config."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", **cfg}))
    tensors = {"model.embed_tokens.weight": torch.zeros(3, 4)}
    tensors |= {f"model.layers.{i}.mlp.w.weight": torch.zeros(4, 4) for i in range(layers)}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _raw_safetensors(path: Path, header: dict[str, Any], data: bytes = b"", length: int | None = None) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


def test_config_past_its_bounds_or_unlike_its_weights_is_refused(stack: Stack) -> None:
    base = _models(stack)
    ok = {"num_hidden_layers": 2, "hidden_size": 4, "vocab_size": 3}
    huge = _layered(base / "huge", 2, {**ok, "num_hidden_layers": 1_000_000})
    msg = _refused(stack, {"kind": "fisher", "spec": {"model": str(huge)}}, "model")
    assert "num_hidden_layers is 1000000; accepted: 0 .. 512" in msg, msg
    other = _layered(base / "other", 2, {**ok, "num_hidden_layers": 40})
    msg = _refused(stack, {"kind": "diff", "spec": {"base": "arith-base", "tuned": str(other)}}, "tuned")
    assert "asks for 40 layers and the weights hold 2" in msg, msg
    wide = _layered(base / "wide", 2, {**ok, "hidden_size": 4096})
    msg = _refused(stack, {"kind": "fisher", "spec": {"model": str(wide)}}, "model")
    assert "hidden_size is 4,096 and the weights' embedding has 4" in msg, msg
    fine = _layered(base / "fine", 2, ok)
    r = stack.client("bob").post("/api/jobs", json={"kind": "fisher", "spec": {"model": str(fine)}})
    assert r.status_code == 201, r.text


def test_hostile_safetensors_headers_are_refused_at_submit(stack: Stack) -> None:
    base = _models(stack) / "headers"
    base.mkdir()
    cases = {
        # a header length of 94 MB: refused before it is read
        "big": (_raw_safetensors(base / "big.safetensors", {}, length=94_000_000), "94,000,000-byte header"),
        # 200,001 empty tensors in a 12 MB header
        "many": (_raw_safetensors(base / "many.safetensors", {
            f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_001)}),
            "holds 200,001 tensors; at most 200,000"),
        # offsets past the end of the file
        "offsets": (_raw_safetensors(base / "offsets.safetensors", {
            "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, data=b"\0" * 8),
            "end at byte 16 of a 8-byte data section"),
        # a shape far larger than its bytes
        "shape": (_raw_safetensors(base / "shape.safetensors", {
            "w": {"dtype": "F32", "shape": [1_000_000, 1_000_000], "data_offsets": [0, 16]}},
            data=b"\0" * 16), "is 4,000,000,000,000 bytes, its offsets span 16"),
    }
    for name, (path, words) in cases.items():
        msg = _refused(stack, {"kind": "mask", "spec": {"fisher": str(path), "density": 0.1}}, "fisher")
        assert words in msg, (name, msg)
    # the same checks for a model's weight file
    model = _model_folder(base / "model")
    _raw_safetensors(model / "model.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})
    msg = _refused(stack, {"kind": "fisher", "spec": {"model": str(model)}}, "model")
    assert "'model.safetensors' is not a valid safetensors file" in msg, msg


def _estimate(stack: Stack, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    r = stack.client("bob").post("/api/estimate", json={"kind": kind, "spec": spec})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_costs_count_what_the_runner_may_do(stack: Stack) -> None:
    # a mask reads its Fisher: the cost is the Fisher's elements (it was 0)
    fisher = _models(stack) / "cost-fisher.safetensors"
    save_file({"a": torch.rand(300, 7), "b": torch.rand(11)}, str(fisher))
    est = _estimate(stack, "mask", {"fisher": str(fisher), "density": 0.1})
    assert est["cost"] == 300 * 7 + 11, est
    # until_reliable may double up to max_prompts: it costs what max_prompts costs
    worst = _estimate(stack, "fisher", {"model": "arith-base", "prompts": 2, "until_reliable": True,
                                        "max_prompts": 4096})
    full = _estimate(stack, "fisher", {"model": "arith-base", "prompts": 4096})
    first = _estimate(stack, "fisher", {"model": "arith-base", "prompts": 2})
    assert worst["token_passes"] == full["token_passes"] == 2048 * first["token_passes"], (worst, full, first)
    # a user's fisherlens.json cannot shrink the count: their headers are counted
    forged = _layered(_models(stack) / "forged", 2, {"num_hidden_layers": 2, "hidden_size": 4, "vocab_size": 3})
    (forged / "fisherlens.json").write_text(json.dumps({"params": 1}))
    est = _estimate(stack, "fisher", {"model": str(forged)})
    assert est["params"] == 3 * 4 + 2 * 16, est
