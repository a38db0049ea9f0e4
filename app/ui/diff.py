"""New job -> Checkpoint diff: which weights a fine-tune changed, against the Fisher (DiffSpec)."""

from app.ui.formtab import FormDef

FORM = FormDef(kind="diff", title="Checkpoint diff", button="Diff", cost=False,
               main=("base", "tuned", "fisher", "topk_percent"))
