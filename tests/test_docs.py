"""The user documentation: docs/ exists in the repository, every link in README.md and docs/*.md
resolves (file and heading), nothing points at files outside the repository, and the facts the docs
state (the canonical byte layout's worked example, the exit status table) match the code."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import ternary_rs
from ternary_rs import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def test_docs_exist_and_links_resolve():
    names = {p.name for p in DOCS}
    assert {"checkpoint.md", "formats.md", "cli.md"} <= names
    for md in DOCS:
        text = md.read_text()
        assert "shared/" not in text and "DESIGN.md" not in text and "FORMATS.md" not in text, md
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            assert dest.is_file(), (md.name, target)
            if anchor:
                assert anchor in _anchors(dest), (md.name, target)


def test_checkpoint_doc_worked_example_matches_the_packing():
    text = (ROOT / "docs" / "checkpoint.md").read_text()
    assert "qweight = 0b00_00_01_10 = 0x06,  0b01_10_10_01 = 0x69" in text
    trits = np.array([[1, 0, -1, -1, 0, 1, 1, 0]], dtype=np.int8)
    assert ternary_rs.pack_codes(trits).tolist() == [[0x06, 0x69]]


def test_cli_doc_lists_the_exit_status_the_command_uses():
    text = (ROOT / "docs" / "cli.md").read_text()
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", text, flags=re.M)}
    assert documented == {cli.EXIT_OK, cli.EXIT_FAIL, cli.EXIT_USAGE, cli.EXIT_INTERRUPTED, cli.EXIT_PIPE}
    for code in documented:
        assert f"\n  {code} " in cli.EXIT_STATUS_HELP or f"\n  {code}  " in cli.EXIT_STATUS_HELP
