"""fisherlens inside other people's trainers.

`compute.integrations.trl`: `FisherMaskCallback` (train only inside a fisherlens mask) and
`UpdateSparsityCallback` (log update sparsity vs a base) for TRL's trainers and the plain HF
`transformers.Trainer` (install with `pip install -e .[trl]`).

Importing this package imports neither transformers nor trl; `compute.integrations.trl` does.
"""
