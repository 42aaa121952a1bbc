"""Every requirement id the repository cites resolves in docs/requirements.md.

Code, tests and docs cite requirements as ``SPEC T1``, ``(SPEC T1, T5, Z3)``,
``SPEC C1–C4``, ``SPEC S3/S4`` or, bare in parentheses, ``(Q3)`` and ``(O2, Z3)``.
A citation is only worth something if a reader can look it up, so each cited id
(both ends of a range, and every id between them) must be defined in
docs/requirements.md as a ``- **ID** —`` item.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "docs" / "requirements.md"

_ID = r"[A-Z]\d{1,2}"
_CITATION = re.compile(rf"\bSPEC ({_ID}(?:\s*(?:,|/|–|-|and)\s*{_ID})*)")
#: The letters of the requirement families: a bare ``(X1)`` counts only with one of these.
LETTERS = "CASPTXZFOQWNM"
_BARE_ID = rf"[{LETTERS}]\d{{1,2}}"
_BARE = re.compile(rf"\(({_BARE_ID}(?:\s*(?:,|/|–|-|and)\s*{_BARE_ID})*)[,;)]")
_RANGE = re.compile(rf"({_ID})\s*[–-]\s*({_ID})")
_DEFINED = re.compile(rf"^- \*\*({_ID})\*\* — ", re.M)
_SUFFIXES = (
    ".py", ".pyi", ".lua", ".md", ".toml", ".yaml", ".yml", ".sh", ".proto", ".txt", ".sql",
    ".json", ".ts", "Tiltfile", "Dockerfile",
)  # fmt: skip


def _tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    names = [n for n in out.split("\0") if n]
    paths = [ROOT / n for n in names if n.endswith(_SUFFIXES) or n.startswith("scripts/")]
    return [p for p in paths if p.is_file()]


def _expand(citation: str) -> set[str]:
    ids = set(re.findall(_ID, citation))
    for first, last in _RANGE.findall(citation):
        if first[0] == last[0]:
            ids |= {f"{first[0]}{n}" for n in range(int(first[1:]), int(last[1:]) + 1)}
    return ids


def cited_ids() -> dict[str, set[str]]:
    """Each cited id and the files that cite it."""
    cited: dict[str, set[str]] = {}
    for path in _tracked_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for pattern in (_CITATION, _BARE):
            for match in pattern.finditer(text):
                for rid in _expand(match.group(1)):
                    cited.setdefault(rid, set()).add(str(path.relative_to(ROOT)))
    return cited


def defined_ids() -> set[str]:
    return set(_DEFINED.findall(REQUIREMENTS.read_text(encoding="utf-8")))


def test_every_cited_requirement_is_defined() -> None:
    defined = defined_ids()
    missing = {rid: sorted(files)[:3] for rid, files in cited_ids().items() if rid not in defined}
    assert not missing, f"cited but not in docs/requirements.md: {missing}"


def test_the_citation_scan_finds_citations() -> None:
    """The scan must see the repository's citations, or the test above proves nothing."""
    cited = cited_ids()
    assert {"Z3", "S4", "F2", "T1"} <= cited.keys()
    assert _expand("C1–C4") == {"C1", "C2", "C3", "C4"}
    assert _expand("T1, T5, Z3") == {"T1", "T5", "Z3"}
    assert _BARE.search("a fail-open cap (Q3) holds") is not None
    assert _BARE.search("(O2, Z3)") is not None


def test_every_requirement_family_is_cited_and_defined() -> None:
    """Each family the code cites (C A S P T X Z F O Q W N M; G once cited) has its
    items here, and the scan sees citations of each: a family it missed would go
    unchecked."""
    cited_letters = {rid[0] for rid in cited_ids()}
    defined_letters = {rid[0] for rid in defined_ids()}
    assert set(LETTERS) <= cited_letters, f"no citation seen of {set(LETTERS) - cited_letters}"
    assert set(LETTERS) <= defined_letters, f"not defined: {set(LETTERS) - defined_letters}"


def test_each_requirement_is_defined_once() -> None:
    found = _DEFINED.findall(REQUIREMENTS.read_text(encoding="utf-8"))
    assert len(found) == len(set(found))
    assert {"C1", "O6", "Q4", "W2"} <= set(found)


def test_code_cites_requirements_not_issue_numbers() -> None:
    """An issue number means nothing to a reader of the code; the requirement it built does."""
    pattern = re.compile(r"\bissue #?\d+", re.I)
    found = [
        str(path.relative_to(ROOT))
        for path in _tracked_files()
        if path.name.endswith(_SUFFIXES)
        and path.name != "test_requirements.py"
        and pattern.search(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not found, f"cite the requirement instead of the issue: {found}"
