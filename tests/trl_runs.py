"""A real TRL run folder for tests: GRPOTrainer with save_steps=1 on a zoo model (CPU, seconds).

TRL writes output_dir/checkpoint-<step>/ with model.safetensors, config.json, trainer_state.json,
optimizer.pt, scheduler.pt, rng_state.pth, training_args.bin and the tokenizer: the layout
`fisherlens series` reads."""

from __future__ import annotations

from pathlib import Path


def grpo_run_folder(model_dir: Path, out_dir: Path, steps: int = 3, dtype: str = "float32",
                    lr: float = 1e-3) -> Path:
    """Train `model_dir` for `steps` GRPO steps on the arithmetic task, one checkpoint per step.
    dtype 'bfloat16' loads (and so saves) the weights in bf16."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from compute.lm.verifiable_tasks import get_task

    task = get_task("arithmetic")
    examples = task.examples(8 * steps, seed=0)
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples])

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [task.reward(c, a) for c, a in zip(completions, answer, strict=True)]

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, save_steps=1, per_device_train_batch_size=16,
        num_generations=4, max_completion_length=6, learning_rate=lr, logging_steps=1, report_to=[],
        use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                processing_class=tok).train()
    return out_dir
