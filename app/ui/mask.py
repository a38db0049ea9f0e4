"""New job -> Mask: a parameter mask from a Fisher, weights or gradients (MaskSpec)."""

from app.ui.formtab import FormDef

FORM = FormDef(kind="mask", title="Mask", button="Build mask", cost=False,
               main=("fisher", "select", "density", "model", "seed"))
