"""New job -> Fisher: the diagonal Fisher of a model on a task (FisherSpec)."""

from app.ui.formtab import FormDef

FORM = FormDef(kind="fisher", title="Fisher", button="Compute Fisher",
               main=("model", "task", "estimator", "prompts", "samples", "seed", "max_new_tokens",
                     "temperature", "exact_output"))
