"""Citations of the documentation resolve: every ``docs/<file>.md#<anchor>`` written in the repository's
sources (python/, rust/ without build output, cuda/, tests/, benches/, scripts/, README.md, docs/) names a
file under docs/ and an anchor defined in it — an explicit ``<a id="…">`` or a GitHub heading slug — and every
Markdown link of README.md and docs/*.md (to a file under docs/, to a sibling file, or within the page, with or
without an anchor) does too.

The format and design references live in docs/ (formats.md, design.md, checkpoint.md); the sources must cite
them there, never the out-of-repository notes they were first written from, so a citation of those notes'
file names fails here. A quoted file name (a string literal such as a guard in tests/test_docs.py) is not a
citation. Needs nothing but the standard library.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

SCAN_DIRS = ("python", "rust", "cuda", "tests", "benches", "scripts", "docs")
SCAN_FILES = ("README.md",)
SKIP_DIRS = {"target", ".git", "__pycache__", ".hypothesis", ".pytest_cache", "node_modules", ".venv", "venv"}
SUFFIXES = {
    ".py", ".pyi", ".rs", ".cu", ".cuh", ".h", ".hpp", ".c", ".cc", ".cpp", ".sh", ".toml", ".md", ".txt",
    ".cfg", ".ini", ".yml", ".yaml",
}

# ``docs/formats.md#tq2_0``; an anchor ends at the first character a slug or id of ours cannot hold.
CITATION = re.compile(r"docs/([A-Za-z0-9_.-]+\.md)#([A-Za-z0-9_-]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
EXPLICIT_ANCHOR = re.compile(r"""<a\s+(?:id|name)\s*=\s*["']([^"']+)["']""")
# The external notes' file names, spelled so that this file does not cite them itself.
EXTERNAL_NOTES = tuple(stem + ".md" for stem in ("FORMATS", "DESIGN", "PERF_NOTES"))
EXTERNAL = re.compile(r"\b(" + "|".join(re.escape(n) for n in EXTERNAL_NOTES) + r")")


def _sources() -> list[Path]:
    out = [ROOT / f for f in SCAN_FILES if (ROOT / f).is_file()]
    for d in SCAN_DIRS:
        base = ROOT / d
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            rel = p.relative_to(ROOT).parts
            if any(part in SKIP_DIRS for part in rel) or not p.is_file() or p.suffix not in SUFFIXES:
                continue
            out.append(p)
    return out


def _text(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _slug(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to hyphens."""
    title = re.sub(r"<[^>]+>", "", title).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title))


def anchors(md: Path) -> set[str]:
    """Every anchor a link into ``md`` may use: explicit ``<a id>``/``<a name>`` and heading slugs
    (outside fenced code; a repeated heading gets ``-1``, ``-2``, … as on GitHub)."""
    out: set[str] = set()
    seen: Counter[str] = Counter()
    fence = None
    for line in md.read_text(encoding="utf-8").splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            mark = stripped[:3]
            fence = None if fence == mark else (fence or mark)
            continue
        if fence:
            continue
        out.update(EXPLICIT_ANCHOR.findall(line))
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(2))
            out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return out


_ANCHOR_CACHE: dict[Path, set[str]] = {}


def _anchors_of(md: Path) -> set[str]:
    if md not in _ANCHOR_CACHE:
        _ANCHOR_CACHE[md] = anchors(md)
    return _ANCHOR_CACHE[md]


def _where(p: Path, text: str, pos: int) -> str:
    return f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


def test_every_doc_citation_resolves():
    bad = []
    count = 0
    for p in _sources():
        text = _text(p)
        if text is None:
            continue
        for m in CITATION.finditer(text):
            count += 1
            name, anchor = m.groups()
            target = DOCS / name
            if not target.is_file():
                bad.append(f"{_where(p, text, m.start())}: {m.group(0)}: no file docs/{name}")
            elif anchor not in _anchors_of(target):
                bad.append(f"{_where(p, text, m.start())}: {m.group(0)}: no anchor '{anchor}' in docs/{name}")
    assert not bad, f"{len(bad)} of {count} citations do not resolve:\n" + "\n".join(bad)


def test_no_citation_of_the_external_notes():
    """Sources cite docs/…md#anchor, never the notes outside the repository (a quoted name is not a citation)."""
    bad = []
    for p in _sources():
        text = _text(p)
        if text is None:
            continue
        for m in EXTERNAL.finditer(text):
            before = text[m.start() - 1] if m.start() else ""
            after = text[m.end()] if m.end() < len(text) else ""
            if before in "\"'" and before and after == before:
                continue  # a string literal, e.g. a guard that docs never mention the file
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            line = text[start : end if end >= 0 else len(text)]
            bad.append(f"{_where(p, text, m.start())}: {line.strip()}")
    assert not bad, (
        f"{len(bad)} citations of notes outside the repository; cite docs/formats.md#…, docs/design.md#… or "
        "docs/checkpoint.md#… instead:\n" + "\n".join(bad)
    )


def test_markdown_links_resolve_with_explicit_anchors():
    """README.md and docs/*.md links (file and anchor), explicit ``<a id>`` anchors included."""
    bad = []
    for md in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        if not md.is_file():
            continue
        text = md.read_text(encoding="utf-8")
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, …
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                bad.append(f"{_where(md, text, m.start())}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors_of(dest):
                bad.append(f"{_where(md, text, m.start())}: {target}: no anchor '{anchor}'")
    assert not bad, "\n".join(bad)


def test_explicit_anchors_are_unique_and_listed():
    """An id defined twice in one file makes a link ambiguous; formats.md's anchor list names every id."""
    for md in sorted(DOCS.glob("*.md")):
        ids = EXPLICIT_ANCHOR.findall(md.read_text(encoding="utf-8"))
        dup = sorted(k for k, v in Counter(ids).items() if v > 1)
        assert not dup, f"{md.name}: anchors defined twice: {dup}"
    text = (DOCS / "formats.md").read_text(encoding="utf-8")
    listed_at = text.find('<a id="anchors"></a>')
    assert listed_at >= 0, "formats.md has no anchor list"
    listed = set(re.findall(r"`([a-z0-9_-]+)`", text[listed_at:]))
    ids = set(EXPLICIT_ANCHOR.findall(text)) - {"anchors"}
    assert ids <= listed, f"formats.md anchors missing from its anchor list: {sorted(ids - listed)}"
    assert listed <= ids, f"formats.md anchor list names undefined anchors: {sorted(listed - ids)}"


def test_slugs_follow_github():
    assert _slug("What `convert --to gguf` writes") == "what-convert---to-gguf-writes"
    assert _slug("`general.file_type`") == "generalfile_type"
    assert _slug("Bonsai 2 Hadamard rotation") == "bonsai-2-hadamard-rotation"
    assert _slug("TQ2_0") == "tq2_0"
