"""Which prompt format SmolLM2-135M-Instruct (the zoo conversion) completes correctly, before any
training: the probe behind the format of benchmarks/data/smollm2_add.jsonl. For each format and
operand range, 12 additions x 4 samples at temperature 1, 8 new tokens; correct = the completion's
first integer equals a + b. Writes benchmarks/results/real_smollm2/prompt_probe.json.

    fisherlens zoo add smollm2-135m
    python benchmarks/data/probe_smollm2_prompts.py
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "real_smollm2" / "prompt_probe.json"
FORMATS = {
    "bare": "{a}+{b}=",
    "question": "Question: What is {a} plus {b}?\nAnswer:",
    "qa": "Q: {a} + {b} = ?\nA: {a} + {b} =",
}
RANGES = {"one-digit": (0, 10), "two-digit": (10, 100)}


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from compute.contract.settings import get_settings

    path = get_settings().zoo_dir / "smollm2-135m"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = []
    for rname, (lo, hi) in RANGES.items():
        for fname, fmt in FORMATS.items():
            torch.manual_seed(0)
            rng = random.Random(0)
            ok = n = 0
            for _ in range(12):
                a, b = rng.randrange(lo, hi), rng.randrange(lo, hi)
                ids = tok(fmt.format(a=a, b=b), return_tensors="pt")
                out = model.generate(**ids, do_sample=True, temperature=1.0, max_new_tokens=8,
                                     num_return_sequences=4, pad_token_id=tok.eos_token_id)
                for o in out:
                    m = re.search(r"-?\d+", tok.decode(o[ids.input_ids.shape[1]:], skip_special_tokens=True))
                    n += 1
                    ok += m is not None and int(m.group()) == a + b
            rows.append({"operands": rname, "format": fname, "prompt": fmt, "correct": ok / n, "samples": n})
            print(rows[-1], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "python benchmarks/data/probe_smollm2_prompts.py", "rows": rows},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
