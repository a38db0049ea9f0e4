"""New job -> Train: GRPO / OPD / SFT, optionally inside a mask (TrainSpec)."""

from app.ui.formtab import FormDef

FORM = FormDef(kind="train", title="Train", button="Train",
               main=("model", "task", "algo", "teacher", "mask", "mask_select", "mask_density",
                     "optimizer", "lr", "steps", "batch", "group", "seed", "precision"))
