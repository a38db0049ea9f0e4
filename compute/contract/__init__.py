"""Torch-free modules every process may import: settings, job specs, result schemas."""
