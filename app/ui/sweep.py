"""New job -> LR x optimizer sweep: a grid of training runs, each diffed against the base
(SweepSpec)."""

from app.ui.formtab import FormDef

FORM = FormDef(kind="sweep", title="LR x optimizer sweep", button="Run sweep",
               main=("model", "algo", "teacher", "lrs", "optimizers", "precision", "steps", "seed"))
