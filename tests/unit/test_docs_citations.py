"""Papers are cited by name and section, not by the hashed file names their text is kept under
(issue 38): docs/papers.md alone maps names to files."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAPER_FILE = re.compile(r"\b00[0-9]_[0-9a-f]{16}\b")
CITED_NAMES = ("FuncPipe", "Gillis", "Hydrozoa", "slsML", "PipeDream dissertation")


def _sources() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    for folder in ("flatpack", "tests", "benchmarks", "docs"):
        found += [path for path in (ROOT / folder).rglob("*") if path.suffix in {".py", ".md", ".toml"}]
    return [path for path in found if path.is_file() and path.name != "papers.md"]


def test_no_file_cites_a_paper_by_its_file_name():
    offenders = [f"{path.relative_to(ROOT)}:{number}" for path in _sources()
                 for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                 if PAPER_FILE.search(line) and path != Path(__file__).resolve()]
    assert not offenders, f"cite these by paper name and section (docs/papers.md): {offenders}"


def test_papers_md_names_every_paper_and_its_file():
    text = (ROOT / "docs" / "papers.md").read_text()
    for name in CITED_NAMES:
        assert f"| {name} |" in text
    assert len(set(PAPER_FILE.findall(text))) == len(CITED_NAMES)
