"""The seconds each test file took in a whole-suite run, for ordering the groups (tests/conftest.py).

``python tests/durations.py RUN.xml`` rewrites tests/durations.json from a run's JUnit report
(``scripts/test.sh --junitxml=RUN.xml``); a file missing from it is weighed by its tests' kinds instead.
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


def load() -> dict[str, int]:
    try:
        return json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=0) + "\n")
