"""Long randomized trials of the compiler's properties (``tests/property/``): the suite runs
each property on a few dozen derandomized examples (200 for the main one); this runs them on
fresh random examples under the ``soak`` hypothesis profile (``tests/conftest.py``): 1,000
examples for the main property and five times the suite's count for the others.

    python benchmarks/property_trials.py                                  # equivalence + structure (~30 min on 2 cores)
    python benchmarks/property_trials.py -k export_frontend               # one property
    python benchmarks/property_trials.py --profile ci                     # the suite's own examples

Prints one row per property: its outcome, how many examples passed, failed and were rejected
as invalid (hypothesis's statistics), and its wall time. A failure prints the failing spec and
a ``@reproduce_failure`` blob above the table (pytest's output, kept).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from flatpack.table import format_table

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = ("tests/property/test_equivalence.py", "tests/property/test_structure.py")
# hypothesis --hypothesis-show-statistics: "tests/x.py::test_y:" then
# "- 12 passing examples, 0 failing examples, 3 invalid examples"
TEST_LINE = re.compile(r"^(?P<test>\S+::\S+):$")
COUNTS_LINE = re.compile(r"(?P<passing>\d+) passing examples?, (?P<failing>\d+) failing examples?, "
                         r"(?P<invalid>\d+) invalid examples?")


@dataclass(frozen=True)
class Trial:
    """One property's run: its outcome (from pytest's report) and hypothesis's example counts."""

    test: str
    outcome: str
    passing: int
    failing: int
    invalid: int
    seconds: float


def example_counts(output: str) -> dict[str, tuple[int, int, int]]:
    """(passing, failing, invalid) per test, summed over hypothesis's phases."""
    counts: dict[str, tuple[int, int, int]] = {}
    test = None
    for line in output.splitlines():
        header = TEST_LINE.match(line.strip())
        if header:
            test = header["test"].split("::")[-1]
            continue
        found = COUNTS_LINE.search(line)
        if found and test is not None:
            before = counts.get(test, (0, 0, 0))
            counts[test] = tuple(a + int(b) for a, b in zip(before, found.groups()))  # type: ignore[assignment]
    return counts


def outcomes(report: Path) -> dict[str, tuple[str, float]]:
    """(outcome, seconds) per test from pytest's JUnit XML report."""
    found: dict[str, tuple[str, float]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "FAILED"
            elif child.tag == "skipped":
                outcome = "skipped"
        found[case.get("name", "?")] = (outcome, float(case.get("time", 0.0)))
    return found


def run_trials(files: list[str], keyword: str | None, profile: str) -> tuple[list[Trial], int]:
    with tempfile.TemporaryDirectory() as temp:
        report = Path(temp) / "report.xml"
        # -n 0: in one process, since hypothesis prints its statistics only there (pyproject's
        # addopts would spread the trials over xdist workers)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q",
                   "--hypothesis-show-statistics", f"--junitxml={report}", *files]
        if keyword:
            command += ["-k", keyword]
        env = {**os.environ, "HYPOTHESIS_PROFILE": profile, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode not in (0, 1):      # 1: some property failed; anything else: pytest could not run
            sys.stdout.write(done.stdout + done.stderr)
            raise SystemExit(f"pytest exited with {done.returncode}")
        if done.returncode == 1:
            sys.stdout.write(done.stdout)
        counts = example_counts(done.stdout)
        trials = [Trial(test, outcome, *counts.get(test, (0, 0, 0)), seconds)
                  for test, (outcome, seconds) in outcomes(report).items()]
    return trials, done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES), help="property test files")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (one property, say)")
    parser.add_argument("--profile", default="soak", help="hypothesis profile (tests/conftest.py): soak, ci or dev")
    arguments = parser.parse_args()
    trials, returncode = run_trials(arguments.files, arguments.keyword, arguments.profile)
    rows = [(trial.test, trial.outcome, trial.passing, trial.failing, trial.invalid, f"{trial.seconds:.1f}")
            for trial in trials]
    print(f"hypothesis profile {arguments.profile}")
    print(format_table(("property", "outcome", "passing", "failing", "invalid", "wall s"), rows, numeric=(2, 3, 4, 5)))
    return returncode


if __name__ == "__main__":
    raise SystemExit(main())
