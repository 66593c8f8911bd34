"""Context parallel (issue 32 item 3) cannot run here: torch's context-parallel attention (ring attention,
``torch.distributed.tensor.experimental.context_parallel``) handles only the CUDA SDPA kernels (flash, memory
efficient, cuDNN). On CPU, SDPA dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no
sharding strategy, and torch stops there (docs/parallel.md, "Context parallel").

This test keeps that finding true: it runs torch's own API on 2 CPU ranks under torchrun and expects the stop at
that op with torch's message. When a torch version runs it on CPU, this test fails and says so: then
``parallel.context`` can be built and tested here against one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import check, command, job_env, run

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent


def test_torchs_context_parallel_stops_at_the_cpu_attention_op(tmp_path: Path) -> None:
    out = tmp_path / "probe"
    result = check(run(command("torchrun", [str(HERE / "cp_probe.py"), str(out)], 2), env=job_env({}), timeout=120))
    assert not result.left_behind, result.left_behind
    records = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]
    for record in records:
        assert not record["ran"], "torch's context parallel now runs on CPU/gloo: build parallel.context (issue 32)"
        assert record["op"] == "aten._scaled_dot_product_flash_attention_for_cpu.default", record
        assert "does not have a sharding strategy registered" in record["error"], record
