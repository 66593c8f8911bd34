"""Make tests/horovod_torch/hvd_launch.py importable as ``hvd_launch``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
