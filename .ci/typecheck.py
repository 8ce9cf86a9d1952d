"""pyright at basic (pyproject.toml [tool.pyright]) with a per-file ratchet.

The tree is not yet at 0 errors: ``.ci/pyright-baseline.json`` records how many each file has.
A run fails when any file has more errors than recorded (a new file: more than 0), printing
pyright's messages for those files, so no change adds a type error; a file with fewer says so,
and ``python .ci/typecheck.py --update`` records the lower count. Run from the repository root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

BASELINE = Path(__file__).with_name("pyright-baseline.json")


def pyright_errors(root: Path) -> list[dict]:
    """Every error pyright reports for the configured paths, its file relative to ``root``."""
    result = subprocess.run([sys.executable, "-m", "pyright", "--outputjson"], capture_output=True, text=True,
                            cwd=root)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        sys.exit(f"pyright did not report (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
    errors = [diagnostic for diagnostic in report["generalDiagnostics"] if diagnostic["severity"] == "error"]
    for diagnostic in errors:
        diagnostic["file"] = Path(diagnostic["file"]).resolve().relative_to(root).as_posix()
    return errors


def describe(diagnostic: dict) -> str:
    line = diagnostic["range"]["start"]["line"] + 1
    return f"{diagnostic['file']}:{line}: {diagnostic['message']} ({diagnostic.get('rule', 'error')})"


def main(argv: list[str]) -> int:
    root = Path.cwd().resolve()
    errors = pyright_errors(root)
    counts = Counter(diagnostic["file"] for diagnostic in errors)
    if "--update" in argv:
        BASELINE.write_text(json.dumps(dict(sorted(counts.items())), indent=1) + "\n")
        print(f"recorded {sum(counts.values())} pyright errors in {len(counts)} files in {BASELINE.name}")
        return 0
    baseline: dict[str, int] = json.loads(BASELINE.read_text())
    worse = sorted(path for path, count in counts.items() if count > baseline.get(path, 0))
    better = sorted(path for path, count in baseline.items() if counts.get(path, 0) < count)
    for path in worse:
        print(f"{path}: {counts[path]} pyright errors, {baseline.get(path, 0)} recorded:")
        for diagnostic in errors:
            if diagnostic["file"] == path:
                print(f"  {describe(diagnostic)}")
    if better:
        print(f"fewer pyright errors than recorded in {', '.join(better)}: run python .ci/typecheck.py --update")
    total, recorded = sum(counts.values()), sum(baseline.values())
    print(f"pyright (basic): {total} errors, {recorded} recorded")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
