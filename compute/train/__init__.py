"""Masked post-training: GRPO, on-policy distillation (OPD) or SFT, with AdamW or SGD.

    config.py       TrainConfig: the loop's knobs, defaults and ranges taken from TrainSpec
    loop.py         train(): one loop over any objective; save_output, save_checkpoint, objective_gradient
    objectives/     one module per algorithm, its maths (pure loss functions on tensors) and its
                    objective (make_batch, loss): grpo.py, distill.py (OPD), sft.py; base.py the
                    shared batch, log-probs and loss reduction
    optimizers.py   the mask-aware AdamW/SGD (frozen coordinates bit-identical; state and gradients
                    at the mask's coordinates only) and precision
"""

from compute.train.config import ALGOS, OPTIMIZERS, PRECISIONS, TrainConfig
from compute.train.loop import TrainOutcome, objective_gradient, save_checkpoint, save_output, train
from compute.train.optimizers import (
    Coords,
    MaskedOptimizer,
    clip_grad_norm,
    grads_of,
    mask_gradients,
    prepare_masked_params,
    prepare_precision,
    stored_dtype,
    stored_state,
    trainable_count,
)

__all__ = [
    "ALGOS", "OPTIMIZERS", "PRECISIONS", "Coords", "MaskedOptimizer", "TrainConfig", "TrainOutcome", "clip_grad_norm",
    "grads_of", "mask_gradients", "objective_gradient", "prepare_masked_params", "prepare_precision", "save_checkpoint",
    "save_output", "stored_dtype", "stored_state", "train", "trainable_count",
]
