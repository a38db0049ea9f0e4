"""Experiments built on the engine: masked-training retention, the gradient bound, next-token
sensitivities."""
