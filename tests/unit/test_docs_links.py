"""The documentation holds together: every relative link in README.md, ARCHITECTURE.md,
deploy/README.md and docs/ names a file that exists (and, for a `#fragment` into a markdown file, a
heading in it), and the README stays a front page (at most 300 lines, one results table
whose every row names its host, date and commit and links to its record under docs/benchmarks/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted(
    [README, REPO / "ARCHITECTURE.md", REPO / "deploy" / "README.md", *(REPO / "docs").rglob("*.md")]
)

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")
COMMENT = re.compile(r"<!--.*?-->")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a `# comment` in a bash block is no heading),
    one-line HTML comments removed (GitHub renders neither)."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(COMMENT.sub("", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for line in prose_lines(path) for t in LINK.findall(CODE_SPAN.sub("", line))]


def test_the_slug_follows_github() -> None:
    assert slug("Chaos (2026-11-30, c72c8c9)") == "chaos-2026-11-30-c72c8c9"
    assert slug("How kernel changes are measured (A/B)") == "how-kernel-changes-are-measured-ab"
    assert slug("Reading `bench fleet`") == "reading-bench-fleet"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def results_rows() -> list[list[str]]:
    """The data rows of the first table under the README's '## Results'."""
    lines = prose_lines(README)
    start = lines.index("## Results")
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break  # the table ended
    return rows


def test_the_readme_is_a_front_page() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


def test_every_result_names_host_date_commit_and_record() -> None:
    header, _rule, *rows = results_rows()
    assert [h.lower() for h in header[3:7]] == ["host", "date", "commit", "details"]
    assert rows, "the results table has no rows"
    for row in rows:
        assert len(row) == len(header), row
        host, date, commit, details = row[3:7]
        assert host, row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), row
        assert "docs/benchmarks/" in details, row


# how work was tracked, not what the code does (spelled in pieces: this file passes its own check)
PROCESS_WORDS = re.compile(r"issue [0-9]|done" + "-when|design " + "card", re.I)


def test_no_work_process_words() -> None:
    """Docs, records, code and tests say what the code does, not which ticket asked for it."""
    roots = [
        README,
        REPO / "ARCHITECTURE.md",
        REPO / "docs",
        REPO / "fastdecode",
        REPO / "services",
        REPO / "tests",
    ]
    found = []
    for root in roots:
        for f in [root] if root.is_file() else [p for p in root.rglob("*") if p.suffix in (".md", ".py")]:
            for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if PROCESS_WORDS.search(line):
                    found.append(f"{f.relative_to(REPO)}:{n}: {line.strip()[:80]}")
    assert not found, "\n".join(found)
