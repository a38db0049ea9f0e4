"""The Gradio explorer: `build_ui(settings) -> gr.Blocks` (layout.py wires one module per tab)."""

from app.ui.layout import *  # noqa: F403 - transitional, replaced by explicit exports
from app.ui.layout import _range_info, build_ui  # noqa: F401

__all__ = ["build_ui"]
