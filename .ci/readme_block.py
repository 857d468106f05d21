#!/usr/bin/env python3
"""Print one fenced code block of README.md, the one tagged by a marker comment.

    python3 .ci/readme_block.py install     # the block after <!-- readme-test: install -->

Every fenced block of the README carries such a marker on the line before its opening
fence; tests/test_readme.py uses blocks() to run each block by its kind, and .ci/run runs
the install and tests blocks with this script, so what CI runs is what the README says.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r"<!--\s*readme-test:\s*([\w-]+)\s*-->")


def blocks(text: str | None = None) -> list[tuple[str | None, str, str]]:
    """(kind or None when unmarked, language, body) of every fenced block, in order."""
    lines = (README.read_text() if text is None else text).splitlines()
    out, i, prev = [], 0, ""
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang = line[3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            m = MARKER.fullmatch(prev.strip())
            out.append((m.group(1) if m else None, lang, "\n".join(lines[i + 1:j]) + "\n"))
            i, prev = j + 1, ""
            continue
        if line.strip():
            prev = line
        i += 1
    return out


def block(kind: str) -> str:
    found = [body for k, _, body in blocks() if k == kind]
    if len(found) != 1:
        raise SystemExit(f"README.md: {len(found)} blocks tagged '{kind}', expected one")
    return found[0]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    sys.stdout.write(block(sys.argv[1]))
