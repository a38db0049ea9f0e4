"""What a stored result shows, built once per job: figures (Plotly JSON), tables and the key
numbers, for the share page (`app/share.py`) and the UI's result tab.

- `store.py`: build the payload from `app.plots` (every figure builder there is reused, so a
  figure added to `plots.result_figures` appears here without a change) and keep it as one JSON
  file per job in the artifact store, rebuilt only when the code that draws it changes.
- `keynumbers.py`: the few numbers a researcher came for, per job kind.
- `labels.py`: display names for the rows outside the transformer blocks ("embeddings",
  "final norm", "lm_head" instead of the "-" the compute side stores).

No torch, no Gradio here.
"""
