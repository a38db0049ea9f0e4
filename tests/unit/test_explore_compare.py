"""Compare of two stored results through the app: the per-layer x module top-k Jaccard, its
random baseline and Spearman equal a hand computation from the two safetensors files; two masks
compare as sets; incompatible results are a 404 naming the side."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from tests.unit.test_explore_api import _artifact_file, _store, _tensors


@pytest.fixture
def two_fishers(tmp_path: Path):
    from app.web import create_app
    from compute.contract.settings import Settings

    settings = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None)
    client = TestClient(create_app(settings), base_url="http://127.0.0.1")
    jobs = [_store(settings, "fisher", {"fisher": _tensors(seed, "fisher")}) for seed in (0, 1)]
    masks = [_store(settings, "mask", {"mask": _tensors(seed, "mask")}) for seed in (2, 3)]
    return client, settings, jobs, masks


def _hand(a: dict[str, np.ndarray], b: dict[str, np.ndarray], k_percent: float) -> dict[str, dict[str, float]]:
    """Global top-k of each side (ties by sorted name, then position), restricted to each cell."""
    names = sorted(a)
    flat_a = np.concatenate([a[n].reshape(-1) for n in names]).astype(np.float64)
    flat_b = np.concatenate([b[n].reshape(-1) for n in names]).astype(np.float64)
    k = math.floor(k_percent / 100 * flat_a.size + 0.5)
    top_a = np.zeros(flat_a.size, bool)
    top_a[np.lexsort((np.arange(flat_a.size), -flat_a))[:k]] = True
    top_b = np.zeros(flat_b.size, bool)
    top_b[np.lexsort((np.arange(flat_b.size), -flat_b))[:k]] = True
    out: dict[str, dict[str, float]] = {}
    pos = 0
    cells: dict[str, list[np.ndarray]] = {}
    from compute.lm.naming import layer_index, module_type

    for n in names:
        idx = np.arange(pos, pos + a[n].size)
        pos += a[n].size
        layer = layer_index(n)
        cells.setdefault(f"{'-' if layer is None else layer}/{module_type(n)}", []).append(idx)
    for key, parts in cells.items():
        idx = np.concatenate(parts)
        A, B = top_a[idx], top_b[idx]
        inter, union = int((A & B).sum()), int((A | B).sum())
        pa, pb = A.mean(), B.mean()
        from scipy.stats import rankdata

        ra, rb = rankdata(flat_a[idx]), rankdata(flat_b[idx])  # mid-ranks: ties share their mean rank
        out[key] = {"jaccard": inter / union if union else 0.0,
                    "jaccard_baseline": pa * pb / (pa + pb - pa * pb) if pa + pb else 0.0,
                    "spearman": float(np.corrcoef(ra, rb)[0, 1])}
    return out


def test_two_fishers_jaccard_per_cell_equals_the_hand_computation(two_fishers):
    from safetensors.numpy import load_file

    client, settings, jobs, _ = two_fishers
    a, b = (load_file(str(_artifact_file(settings, j["id"], "fisher"))) for j in jobs)
    r = client.get(f"/api/results/{jobs[0]['token']}/compare/{jobs[1]['token']}", params={"k": 5})
    assert r.status_code == 200, r.text
    v = r.json()
    hand = _hand(a, b, 5.0)
    assert len(v["cells"]) == len(hand)
    for c in v["cells"]:
        h = hand[f"{'-' if c['layer'] is None else c['layer']}/{c['module']}"]
        assert c["jaccard"] == pytest.approx(h["jaccard"], abs=1e-12)
        assert c["jaccard_baseline"] == pytest.approx(h["jaccard_baseline"], abs=1e-12)
        assert c["spearman"] == pytest.approx(h["spearman"], abs=1e-9)
    assert v["cached"] is False
    again = client.get(f"/api/results/{jobs[0]['token']}/compare/{jobs[1]['token']}", params={"k": 5}).json()
    assert again["cached"] is True and again["cells"] == v["cells"]
    # the shareable page: overall numbers first, then the maps
    page = client.get(f"/r/{jobs[0]['token']}/compare/{jobs[1]['token']}?k=5")
    assert page.status_code == 200
    html = page.text
    assert html.index("id='fl-compare-key'") < html.index("fl-cmp-fig-0") < html.index("fl-compare-cells")
    assert "Difference map" in html and "random sets of the same sizes" in html


def test_two_masks_compare_as_sets(two_fishers):
    from safetensors.numpy import load_file

    client, settings, _, masks = two_fishers
    a, b = (load_file(str(_artifact_file(settings, j["id"], "mask"))) for j in masks)
    v = client.get(f"/api/results/{masks[0]['token']}/compare/{masks[1]['token']}").json()
    A = np.concatenate([a[n].reshape(-1) for n in sorted(a)]).astype(bool)
    B = np.concatenate([b[n].reshape(-1) for n in sorted(a)]).astype(bool)
    assert v["overall"]["jaccard"] == pytest.approx((A & B).sum() / (A | B).sum())
    assert v["k_percent"] is None


def test_incompatible_and_bad_k(two_fishers, tmp_path):
    client, settings, jobs, _ = two_fishers
    other = _store(settings, "fisher", {"fisher": {"x.weight": torch.ones(3, 3)}})
    r = client.get(f"/api/results/{jobs[0]['token']}/compare/{other['token']}")
    assert r.status_code == 404 and r.json()["detail"].startswith("b: the two results share no parameter")
    r = client.get(f"/api/results/{jobs[0]['token']}/compare/{jobs[1]['token']}", params={"k": 0})
    assert r.status_code == 422 and "k" in r.text
