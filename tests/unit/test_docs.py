"""The repository stands alone: no file points outside it, every link in the README and the docs
resolves to a file in the repository, and every docs page is in the site's navigation."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
# A path that climbs out of the repository into the workplace's folders beside it, or the names of
# the documents kept there (spelled from parts, so that this file names none of them itself).
_BESIDE = "|".join(("sha" + "red", "se" + "eds", r"\.lib" + "rary"))
_DOCS = "|".join(("SCI" + "ENCE", "DES" + "IGN", "CONVEN" + "TIONS", "LAY" + "OUT"))
OUTSIDE = re.compile(rf"(?<![\w.])\.\./({_BESIDE})\b|\b({_DOCS})\.md\b")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.splitlines() if (ROOT / p).is_file()]


def test_no_file_points_outside_the_repository() -> None:
    bad = []
    for path in tracked_files():
        if path.suffix not in {".py", ".md", ".toml", ".yml", ".yaml", ".txt", ".sh", ".cfg", ".ini", ""}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not bad, "files point at documents outside the repository:\n" + "\n".join(bad)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_markdown_link_resolves_inside_the_repository() -> None:
    bad = []
    for md in markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # code is not links
        text = re.sub(r"`[^`\n]*`", "", text)
        for m in LINK.finditer(text):
            target = (m.group(1) or m.group(2)).split("#")[0]
            if not target or re.match(r"[a-z]+://|mailto:", target):
                continue
            dest = (md.parent / target).resolve()
            if not dest.exists() or ROOT not in dest.parents:
                bad.append(f"{md.relative_to(ROOT)}: ({target})")
    assert not bad, "broken or outside links:\n" + "\n".join(bad)


def test_every_docs_page_is_in_the_nav() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for x in node for p in pages(x)]
        if isinstance(node, dict):
            return [p for v in node.values() for p in pages(v)]
        return []

    nav = set(pages(config["nav"]))
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md")} | {"index.md"}
    assert on_disk == nav, f"pages not in nav: {on_disk - nav}; nav without a page: {nav - on_disk}"


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
