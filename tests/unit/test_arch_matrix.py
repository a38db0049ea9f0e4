"""The architecture matrix: every transformers family we know of, as a tiny random model, is
either exact against a float64 one-backward-per-sample reference (relative L1 <= 1e-5 on every
parameter, float32 engine) or refused with an explicit UnsupportedModel error. Tied and untied
heads, left and right padding, `sequence` and `token`, forward batches smaller than N.

`python -m tests.unit.test_arch_matrix` prints the supported / refused table for the README.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from compute.fisher import UnsupportedModel, fisher_from_samples, trainable_parameters
from tests.unit.fisher_tiny import FAMILIES, VOCAB, family_model

# families the engine refuses, and a phrase their error must contain
REFUSED = {
    "mamba": "outside the forward of the module that owns them",
    "qwen2_moe": "mixture-of-experts",
    "mixtral": "mixture-of-experts",
    "olmoe": "mixture-of-experts",
    "gpt_oss": "mixture-of-experts",
}
TOL = 1e-5
LENS = (7, 5, 4)  # three rows of different lengths; forward batches of 2 (< N = 3)
PROMPT = 2  # tokens 0..1 are the prompt; the rest count


def _rows(left: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    L = max(LENS)
    ids = torch.zeros(len(LENS), L, dtype=torch.long)
    am = torch.zeros_like(ids)
    cm = torch.zeros(len(LENS), L, dtype=torch.bool)
    for i, n in enumerate(LENS):
        sl = slice(L - n, L) if left else slice(0, n)
        ids[i, sl] = torch.randint(3, VOCAB, (n,), generator=g)
        am[i, sl] = 1
        cm[i, sl] = torch.arange(n) >= PROMPT
    return ids, am, cm


def reference(model, ids, am, cm) -> dict[str, dict[str, torch.Tensor]]:
    """{estimator: Fisher}: one forward/backward per sample on the unpadded row, float64 (float32
    for a family whose float64 forward fails)."""
    dev = next(model.parameters()).device
    ids, am, cm = ids.to(dev), am.to(dev), cm.to(dev)
    try:
        ref_model = model.double()
        ref_model(input_ids=ids[:1, :2])
    except RuntimeError:  # e.g. XGLM's eager attention cannot run in float64
        ref_model = model.float()
    params = trainable_parameters(ref_model)
    out = {e: {n: torch.zeros(p.shape, dtype=torch.float64, device=dev) for n, p in params.items()}
           for e in ("sequence", "token")}
    counts = {"sequence": 0, "token": 0}
    for r in range(ids.shape[0]):
        x = ids[r][am[r].bool()].unsqueeze(0)
        pos = [t for t in range(1, x.shape[1]) if cm[r][am[r].bool()][t]]
        for est, samples in (("sequence", [pos]), ("token", [[t] for t in pos])):
            for group in samples:
                lp = ref_model(input_ids=x).logits[0].double().log_softmax(-1)
                s = sum(lp[t - 1, x[0, t]] for t in group)
                grads = torch.autograd.grad(s, list(params.values()), allow_unused=True)
                for n, gr in zip(params, grads, strict=True):
                    if gr is not None:
                        out[est][n] += gr.double() ** 2
                counts[est] += 1
    model.float()
    return {e: {n: v / counts[e] for n, v in f.items()} for e, f in out.items()}


def worst_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Max over parameters of the relative L1 error, with a floor of 1e-6 x the model's mean
    Fisher per coordinate (parameters whose true Fisher is 0, e.g. a key bias, stay comparable)."""
    assert set(got) == set(ref)
    total = sum(float(r.abs().sum()) for r in ref.values())
    numel = sum(r.numel() for r in ref.values())
    errs = {n: float((got[n].double() - ref[n]).abs().sum())
            / max(float(ref[n].abs().sum()), 1e-6 * total * ref[n].numel() / numel) for n in ref}
    name = max(errs, key=errs.__getitem__)
    return errs[name], name


def check_family(family: str) -> dict:
    """Run every configuration of one family: {"status": exact|refused, "worst", "variants", ...}."""
    row: dict = {"family": family, "errors": [], "refusals": [], "variants": []}
    for tied in (False, True):
        model = family_model(family, tied=tied)
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        really_tied = head is not None and emb.weight is head.weight
        if tied and not really_tied:
            continue  # the family cannot tie its head
        row["variants"].append("tied" if tied else "untied")
        row["model"] = type(model).__name__
        refs = None
        for left in (False, True):
            ids, am, cm = _rows(left)
            for est in ("sequence", "token"):
                try:
                    got = fisher_from_samples(model, ids, am, cm, estimator=est, batch_size=2)
                except UnsupportedModel as exc:
                    row["refusals"].append(str(exc))
                    continue
                refs = refs or reference(model, *_rows(False))
                err, name = worst_error(got, refs[est])
                row["errors"].append((err, f"tied={tied} left={left} {est}: {name}"))
    row["status"] = "refused" if row["refusals"] else "exact"
    row["worst"] = max(row["errors"], default=(0.0, ""))
    return row


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny ops: one intra-op thread avoids thread hand-off costs (large on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_exact_or_refused(family):
    warnings.filterwarnings("ignore")
    row = check_family(family)
    if family in REFUSED:
        assert row["status"] == "refused" and not row["errors"], row
        for msg in row["refusals"]:
            assert "is not supported by the exact per-sample engine" in msg
            assert REFUSED[family] in msg, msg
        return
    assert not row["refusals"], row["refusals"][:1]
    err, where = row["worst"]
    assert err <= TOL, f"{family}: relative L1 error {err:.3g} at {where}"
    assert len(row["errors"]) == 4 * len(row["variants"])


def main() -> None:
    """Print the supported / refused table (markdown) for the README."""
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    print("| family | model class | heads | result |")
    print("|---|---|---|---|")
    for family in FAMILIES:
        r = check_family(family)
        if r["status"] == "exact":
            res = f"exact (worst relative L1 error {r['worst'][0]:.1e})"
        else:
            msg = r["refusals"][0]
            res = "refused: " + msg.split("engine: ", 1)[-1][:160]
        print(f"| {family} | {r.get('model', '?')} | {', '.join(r['variants'])} | {res} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
