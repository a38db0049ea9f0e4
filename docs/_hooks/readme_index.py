"""mkdocs hook: the site's home page is README.md, with its links made relative to docs/.

One source for the landing page (the README a newcomer sees on the forge is the page the site
opens with), so the two cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parents[2] / "README.md"


def index_markdown(readme: str) -> str:
    """README text with `docs/...` link targets rewritten for a page at the docs root."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "index.md", content=index_markdown(README.read_text())))
    return files
