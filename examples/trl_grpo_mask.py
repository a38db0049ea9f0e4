"""TRL's GRPOTrainer with a fisherlens mask: train only the coordinates the mask keeps.

    pip install -e .[trl]
    fisherlens fisher --model arith-base --prompts 64 --samples 4 --out fisher/
    fisherlens mask --fisher fisher/ --density 0.05 --out mask.safetensors
    python examples/trl_grpo_mask.py --model arith-base --mask mask.safetensors --steps 20 --out runs/grpo

--model is a zoo name (`fisherlens zoo list`), a local HF folder or a hub id. The task is
fisherlens' arithmetic (prompt "12+34=", reward 1 when the first number of the completion is the
answer). Every `--save-steps` steps TRL writes OUT/checkpoint-N (the run folder `fisherlens series`
reads). At the end the script checks, against the model it started from, that every coordinate
outside the mask is bit-identical, and prints the update sparsity that UpdateSparsityCallback
logged; it exits with status 1 if a frozen coordinate moved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="arith-base", help="zoo name, local HF folder or hub id")
    ap.add_argument("--mask", required=True, help="mask .safetensors written by `fisherlens mask --out`")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--out", default="runs/trl-grpo", help="run folder (checkpoint-N inside)")
    ap.add_argument("--task", default="arithmetic", help="fisherlens task (see `fisherlens fisher --help`)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay")
    ap.add_argument("--batch", type=int, default=8, help="completions per step (prompts x generations)")
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO group)")
    ap.add_argument("--max-completion-length", type=int, default=8, help="tokens per completion")
    ap.add_argument("--save-steps", type=int, default=1, help="write OUT/checkpoint-N every this many steps")
    ap.add_argument("--sparsity-every", type=int, default=1, help="log update sparsity every this many steps")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights and autocast (default: float32)")
    ap.add_argument("--full-checkpoints", action="store_true",
                    help="also save optimizer/scheduler state in each checkpoint (default: model only)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from compute.contract.modelref import resolve_model
    from compute.integrations.trl import FisherMaskCallback, UpdateSparsityCallback
    from compute.lm.verifiable_tasks import get_task

    path = resolve_model(a.model)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    task = get_task(a.task)
    n_prompts = a.steps * a.batch // a.generations
    ds = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer}
                            for e in task.examples(n_prompts, seed=a.seed, split="train")])

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [task.reward(c, ans) for c, ans in zip(completions, answer, strict=True)]

    args = GRPOConfig(
        output_dir=a.out, max_steps=a.steps, learning_rate=a.lr, weight_decay=a.weight_decay,
        per_device_train_batch_size=a.batch, num_generations=a.generations,
        max_completion_length=a.max_completion_length, temperature=1.0,
        save_strategy="steps", save_steps=a.save_steps, save_only_model=not a.full_checkpoints,
        logging_steps=1, report_to="none", bf16=a.bf16, gradient_checkpointing=False, seed=a.seed,
    )
    mask_cb = FisherMaskCallback(a.mask)
    sparsity_cb = UpdateSparsityCallback(every=a.sparsity_every)  # base: the weights at train begin
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[mask_cb, sparsity_cb])
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0

    mask = mask_cb.masks
    moved_frozen = moved_kept = 0
    for n, p in model.named_parameters():
        m = mask[n]
        changed = p.detach().cpu() != before[n].cpu()
        if m is None:
            moved_kept += int(changed.sum())
            continue
        m = m.cpu()
        moved_frozen += int(changed[~m].sum())
        moved_kept += int(changed[m].sum())
    rows = [h for h in trainer.state.log_history if "update_sparsity/unchanged_bf16" in h]
    summary = {
        "model": a.model, "steps": trainer.state.global_step, "train_seconds": round(seconds, 2),
        "mask": {k: v for k, v in mask_cb.summary.items()},
        "frozen_coordinates_moved": moved_frozen, "trainable_coordinates_moved": moved_kept,
        "reward_per_step": [h.get("reward") for h in trainer.state.log_history if "reward" in h],
        "update_sparsity_last": {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("update_")},
        "checkpoints": sorted((p.name for p in Path(a.out).glob("checkpoint-*")),
                              key=lambda s: int(s.rsplit("-", 1)[1])),
    }
    print(json.dumps(summary, indent=1))
    return 1 if moved_frozen else 0


if __name__ == "__main__":
    sys.exit(main())
