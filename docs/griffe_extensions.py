"""A griffe extension for the reference pages: the package's docstrings,
read as the site should render them.

The docstrings are Google style with two habits of the package's own:

- their doctests follow a line `Example:`, not indented (as
  `pytest --doctest-modules` and a reader of the source see them); griffe
  wants an indented `Examples:` section, and would render them as Markdown
  text. The lines after `Example:` (up to the next section title) are
  indented under `Examples:`, so the site renders them as code;
- a formula is written `:math:`...`` inline and `.. math:: ...` on lines of
  its own (reStructuredText's role and directive); the site shows it as
  code, as it reads in the source.

The docstrings themselves are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE = re.compile(r"^Example:[ \t]*$")
SECTION = re.compile(r"^[A-Z][A-Za-z ]*:[ \t]*$")  # `Args:`, `Returns:`, ...
MATH = re.compile(r":math:`([^`]+)`")
MATH_BLOCK = re.compile(r"^(\s*)\.\. math::\s*(.*)$")


def examples_section(docstring: str) -> str:
    """`docstring` with its unindented `Example:` block as `Examples:`."""
    out: list[str] = []
    inside = False
    for line in docstring.split("\n"):
        if EXAMPLE.match(line):
            inside = True
            out.append("Examples:")
        elif inside and SECTION.match(line):
            inside = False
            out.append(line)
        else:
            out.append("    " + line if inside and line.strip() else line)
    return "\n".join(out)


def math_blocks(docstring: str) -> str:
    """`docstring` with each `.. math::` directive as a fenced TeX block."""
    out: list[str] = []
    lines = docstring.split("\n")
    i = 0
    while i < len(lines):
        found = MATH_BLOCK.match(lines[i])
        if found is None:
            out.append(lines[i])
            i += 1
            continue
        indent, formula = found.group(1), [found.group(2)]
        i += 1  # its continuation lines are indented deeper
        while i < len(lines) and lines[i].startswith(indent + " ") and lines[i].strip():
            formula.append(lines[i].strip())
            i += 1
        out += [f"{indent}```tex", *(indent + f for f in formula), f"{indent}```"]
    return "\n".join(out)


class PackageDocstrings(griffe.Extension):
    """Rewrites each docstring griffe loads, before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = math_blocks(examples_section(obj.docstring.value))
            obj.docstring.value = MATH.sub(r"`\1`", text)
