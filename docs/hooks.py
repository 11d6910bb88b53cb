"""MkDocs hook: pages kept outside `docs/` join the site without a copy,
and every page's links are written as they resolve in the repository.

The notebooks stay in `notebooks/` (where the tests execute them) and the
project's notes at the repository root (BENCHMARKS.md, CHANGELOG.md,
CONTRIBUTING.md); this hook adds them to the site's files, at their paths
from the repository root, before mkdocs-jupyter turns the notebooks into
pages (rendered with their stored outputs, never executed).

A page links to another file by its path in the repository, relative to
the page (`../../BENCHMARKS.md` from `docs/guide/`, `docs/stable_lr.png`
from BENCHMARKS.md), so that the link works where GitHub renders the page;
`on_page_markdown` rewrites each such link to the site's layout, in which
`docs/` is the root. A link to a file or folder of the repository that the
site does not hold (a source file, `examples/`) keeps its text and loses
its target there; a link to nothing is left as it is, for MkDocs's link
check to report.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ROOT_PAGES = ("BENCHMARKS.md", "CHANGELOG.md", "CONTRIBUTING.md")
# `[text](target)` or `[text](target#anchor)`, the target a relative path.
LINK = re.compile(r"\[([^\]]*)\]\((?![a-z][a-z0-9+.-]*:|/|#)([^)\s#]+)(#[^)\s]*)?\)")


@event_priority(50)  # before mkdocs-jupyter's on_files (priority 0)
def on_files(files: Files, config: Any) -> Files:
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    sources = [*ROOT_PAGES, *(p.relative_to(ROOT).as_posix() for p in notebooks)]
    for src in sources:
        files.append(
            File(src, str(ROOT), config["site_dir"], config["use_directory_urls"])
        )
    return files


def site_path(path: Path) -> str | None:
    """Where the repository's file `path` is in the site (`docs/` is its
    root, the files added above keep their paths), or `None` for a file
    outside the repository."""
    path = path.resolve()
    if path.is_relative_to(DOCS):
        return path.relative_to(DOCS).as_posix()
    if path.is_relative_to(ROOT):
        return path.relative_to(ROOT).as_posix()
    return None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = Path(page.file.abs_src_path).parent
    page_dir = os.path.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        path = here / target
        in_site = site_path(path)
        if in_site is not None and files.get_file_from_path(in_site) is not None:
            return f"[{text}]({os.path.relpath(in_site, page_dir or '.')}{anchor})"
        if in_site is not None and path.exists():
            return text  # the repository's, not the site's
        return match.group(0)  # a link to nothing: MkDocs reports it

    return LINK.sub(rewrite, markdown)
