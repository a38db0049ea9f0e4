"""One small job of every kind, submitted through the REST API of a running `fisherlens up`
(a real worker computes them): fisher -> mask (fisher, 5%) -> masked GRPO in bf16-mixed -> diff
of the base vs that trained job, plus tokens, sweep and retention. Used by the result-tab
screenshots (tests/e2e/test_result_screens.py); run alone against a server to fill it:
    python -m tests.e2e.every_kind http://127.0.0.1:7860
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from typing import Any

SMALL = {"steps": 2, "batch": 2, "group": 2, "max_new_tokens": 4, "eval_prompts": 8, "device": "cpu",
         "fisher_prompts": 2, "fisher_samples": 2}
CHAIN: list[tuple[str, dict[str, Any]]] = [
    ("fisher", {"model": "arith-base", "prompts": 8, "samples": 2, "max_new_tokens": 4, "device": "cpu"}),
    ("mask", {"fisher": "job:{fisher}", "select": "fisher", "density": 0.05}),
    ("train", {"model": "arith-base", "mask": "job:{mask}", "precision": "bf16-mixed", **SMALL}),
    ("diff", {"base": "arith-base", "tuned": "job:{train}", "fisher": "job:{fisher}", "topk_percent": 1.0}),
    ("tokens", {"model": "arith-base", "context": "12+34=", "top_k": 4, "random_k": 3, "device": "cpu"}),
    ("sweep", {"model": "arith-base", "lrs": [1e-4, 1e-2], "optimizers": ["sgd", "adamw"],
               "precision": ["bf16-mixed"], **SMALL}),
    ("retention", {"model": "arith-base", "densities": [0.05, 0.2], "selectors": ["fisher", "random"],
                   "seeds": 1, "bootstrap": 100, **SMALL}),
]


def _call(url: str, data: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _fill(spec: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    return {k: v.format(**ids) if isinstance(v, str) and "{" in v else v for k, v in spec.items()}


def run_chain(base: str, timeout_s: float = 1200) -> dict[str, dict[str, Any]]:
    """kind -> the succeeded job dict (share_token, id, ...), submitted in CHAIN order."""
    ids: dict[str, int] = {}
    done: dict[str, dict[str, Any]] = {}
    for kind, spec in CHAIN:
        job = _call(f"{base}/api/jobs", {"kind": kind, "spec": _fill(spec, ids)})
        deadline = time.monotonic() + timeout_s
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind} job #{job['id']} still {job['status']}")
            time.sleep(1)
            job = _call(f"{base}/api/jobs/{job['id']}")
        if job["status"] != "succeeded":
            raise RuntimeError(f"{kind} job #{job['id']} {job['status']}: {job.get('message')}")
        ids[kind] = job["id"]
        done[kind] = job
    return done


if __name__ == "__main__":
    for k, j in run_chain(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:7860").items():
        print(k, j["id"], j["share_token"])
