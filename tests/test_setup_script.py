"""scripts/setup.sh's own arguments (what it installs is checked by tests/docker and by every other test)."""

import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"


def test_an_unknown_argument_is_one_line_with_exit_code_2(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SETUP), "--everything"], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "POLYTRAIN_VENV": str(tmp_path / "venv")})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["setup.sh: unknown argument '--everything' (allowed: --all, or nothing)"]
    assert not (tmp_path / "venv").exists()  # nothing was installed

