"""`import polytrain` (and the CLI's spec checking) works with neither torch nor TensorFlow importable."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'tensorflow', 'keras', 'horovod', 'deepspeed', 'mpi4py'):
            raise ModuleNotFoundError(f'blocked: {name}')
sys.meta_path.insert(0, Block())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=60)


def test_core_imports_without_frameworks() -> None:
    proc = run_blocked(
        "import polytrain, polytrain.spec.tables, polytrain.validation, polytrain.registry, polytrain.train.trainer, polytrain.cli\n"
        "import polytrain.commands.info, polytrain.world, polytrain.data, polytrain.train.schedule\n"
        "s = polytrain.validation.load(None, ['loop.epochs=2'])\n"
        "print(s.loop.epochs, polytrain.detect_world({}).launcher)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow')))\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["2 single", "[]"]


def test_training_without_torch_is_a_one_line_error() -> None:
    proc = run_blocked("from polytrain.cli import main; sys.exit(main(['train', '--set', 'loop.epochs=1']))")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "polytrain: error: backend: 'local' cannot run here: torch is not installed (pip install 'polytrain[torch]')"]
