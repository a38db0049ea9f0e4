"""Writes benchmarks/data/smollm2_add.jsonl: 1,000 additions a + b (a < 100, b < 10) in the
prompt format SmolLM2-135M-Instruct completes best among the ones tried (benchmarks/data/probe_smollm2_prompts.py):

    Q: 37 + 5 = ?
    A: 37 + 5 =            -> " 42" (reward: the completion's first number, match=numeric)

Measured before training (benchmarks/data/probe_smollm2_prompts.py ->
benchmarks/results/real_smollm2/prompt_probe.json: 12 prompts x 4 samples, temperature 1): this
format 65% correct with one-digit operands, 21% with two-digit ones; "37+5=" alone 10% and 0%. A mix
(a < 100, b < 10) keeps GRPO groups mixed (some right, some
wrong), so the advantages are not all zero. Splits: by hash of the prompt (compute's task loader).

    python benchmarks/data/make_smollm2_add.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("smollm2_add.jsonl")


def main() -> None:
    with OUT.open("w") as f:
        for a in range(100):
            for b in range(10):
                prompt = f"Q: {a} + {b} = ?\nA: {a} + {b} ="
                f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
    print(f"wrote {OUT} (1000 lines)")


if __name__ == "__main__":
    main()
