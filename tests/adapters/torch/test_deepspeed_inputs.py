"""DeepSpeed with bf16 keeps the module's weights in bf16 and runs its forward with CUDA autocast turned off, so
the Trainer's autocast around it does not cast float inputs (digits' features) any more: on the GPU every bf16
and fp16 run on float inputs failed with "mat1 and mat2 must have the same dtype" (docs/gpu-results.md). The
precision component casts floating-point inputs to the weights' dtype where the backend keeps its weights in the
training precision (``weights_in_precision``); here that is checked on the CPU with no autocast at all, which is what
the GPU sees."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from procs import check, loopback_env, run

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("deepspeed_inputs_worker.py")


@pytest.mark.slow
def test_bf16_engine_takes_fp32_inputs_without_autocast(tmp_path: Path) -> None:
    done = check(run([sys.executable, str(WORKER), "bf16", str(tmp_path)], timeout=200, env=loopback_env()))
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["weights"] == "torch.bfloat16" and got["out"] == "torch.bfloat16"
    assert 0 < got["loss"] < 100  # a finite summed cross-entropy of 8 samples over 3 classes (about 8 × ln 3)
