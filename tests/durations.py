"""The seconds each test file took in a whole-suite run, for ordering the groups (tests/conftest.py).

``python tests/durations.py RUN.xml`` rewrites tests/durations.json from a run's JUnit report
(``scripts/test.sh --junitxml=RUN.xml``); a file missing from it is weighed by its tests' kinds instead. It also
prints the tests that took the most CPU (their processes' included: tests/conftest.py records it), which is
what a test costs a CPU-bound run.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TABLE = Path(__file__).resolve().parent / "durations.json"


def from_junit(report: Path) -> dict[str, int]:
    seconds: dict[str, float] = {}
    for case in ET.parse(report).iter("testcase"):
        path = case.get("classname", "").removeprefix("tests.").replace(".", "/") + ".py"
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0))
    return {path: round(s) for path, s in sorted(seconds.items()) if round(s) > 0}


def cpu_heaviest(report: Path, count: int = 40) -> list[tuple[float, str]]:
    """The ``count`` tests with the most CPU seconds in the run, heaviest first."""
    found = []
    for case in ET.parse(report).iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") == "cpu_s":
                found.append((float(prop.get("value", 0)), f"{case.get('classname')}::{case.get('name')}"))
    return sorted(found, reverse=True)[:count]


def load() -> dict[str, int]:
    try:
        return json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=0) + "\n")
    for seconds, name in cpu_heaviest(Path(sys.argv[1])):
        print(f"{seconds:8.1f} s CPU  {name}")
