"""New job -> Retention sweep: masked training at several densities and selectors against full
training and the base (RetentionSpec)."""

from app.ui.formtab import FormDef

FORM = FormDef(kind="retention", title="Retention sweep", button="Run retention sweep",
               main=("model", "algo", "teacher", "densities", "selectors", "seeds", "steps", "lr"))
