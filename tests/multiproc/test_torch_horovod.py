"""PyTorch on ``backend: horovod`` trains exactly like one process, under every launcher it is used with.

The spec of the sharded-backends parity test (transformer LM on token data, SGD with momentum,
cosine decay, 2 micro-steps of accumulation so ``backward_passes_per_step=2`` matters, clipping
that bites, 22 steps): 2 ranks × 8 × 2 vs 1 process × 16 × 2. Per-step losses within 1e-5
relative, final weights within 1e-5 of each tensor's largest value, ranks bit-identical.

Under horovodrun (gloo and MPI controllers) and mpirun the real Horovod runs the job; under
torchrun polytrain's implementation on torch.distributed does. The start-up line names which.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from procs import trained_run
from specs import PARITY_TRAINING, as_sets, lm, merged

from polytrain.horovod.common import _import_error

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

HOROVOD = _import_error("horovod.torch") is None
needs_horovod = pytest.mark.skipif(not HOROVOD, reason="real Horovod is not installed (scripts/build_horovod.sh)")

LM = as_sets(merged(lm(), PARITY_TRAINING))
STEPS, TOLERANCE = 22, 1e-5


def trained(out: Path, changes: list[str], launcher: str, nproc: int,
            **extra_env: str) -> tuple[np.ndarray, dict, dict, str]:
    """The LM job with ``changes`` under ``launcher`` (procs.command's names): per-step losses, weights,
    manifest and the whole output."""
    env: dict[str, str | None] = dict(extra_env)
    if launcher in ("mpirun", "horovodrun-mpi", "horovodrun-gloo"):
        env["MASTER_ADDR"] = None  # as a user's shell would have it: Horovod/mpirun set up their own
    run = trained_run(out, [*LM, *changes], launcher=launcher, nproc=nproc, quiet=False, env=env, timeout=450)
    return run.losses, run.state, run.manifest, run.output


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, dict, dict, str]:
    return trained(tmp_path_factory.mktemp("local"), ["backend=local", "data.batch_size=16"], "python", 1)


def assert_matches(run_: tuple[np.ndarray, dict, dict, str], reference: tuple[np.ndarray, dict, dict, str],
                   tolerance: float = TOLERANCE) -> None:
    losses, state, manifest, _ = run_
    ref_losses, ref_state, _, _ = reference
    assert manifest["backend"] == "horovod" and manifest["world_size"] == 2
    assert len(set(manifest["rank_state_digests"])) == 1  # the two ranks hold identical weights
    assert len(losses) == len(ref_losses) == STEPS
    np.testing.assert_allclose(losses, ref_losses, rtol=tolerance)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=0, atol=tolerance * float(np.abs(value).max()),
                                   err_msg=name)


LAUNCHERS = [
    pytest.param("horovodrun-gloo", "Horovod implementation", marks=needs_horovod),
    pytest.param("horovodrun-mpi", "Horovod implementation", marks=needs_horovod),
    pytest.param("mpirun", "Horovod implementation", marks=needs_horovod),
    pytest.param("torchrun", "polytrain implementation"),
]


@pytest.mark.parametrize(("launcher", "implementation"), LAUNCHERS)
def test_horovod_backend_matches_one_process(tmp_path: Path, reference, launcher: str, implementation: str) -> None:
    result = trained(tmp_path, ["backend=horovod", "data.batch_size=8"], launcher, 2)
    assert f"torch/horovod ({implementation}) on 2" in result[3], result[3][-3000:]
    assert_matches(result, reference)


def test_the_shim_under_mpirun_moves_gradients_over_mpi_and_matches_one_process(tmp_path: Path, reference) -> None:
    """Without real Horovod, under mpirun the shim's buckets and the Trainer's collectives go over MPI."""
    pytest.importorskip("mpi4py")
    result = trained(tmp_path, ["backend=horovod", "data.batch_size=8"], "mpirun", 2, POLYTRAIN_HOROVOD_IMPL="shim")
    assert "torch/horovod (polytrain implementation, over MPI) on 2" in result[3], result[3][-3000:]
    assert_matches(result, reference)


def test_fp16_compression_trains_close_to_fp32(tmp_path: Path, reference) -> None:
    """Gradients sent as float16: the run follows fp32 to float16 rounding, and not bit for bit."""
    losses, state, manifest, _ = trained(tmp_path, ["backend=horovod", "data.batch_size=8",
                                                    "horovod.compression=fp16"], "torchrun", 2)
    ref_losses = reference[0]
    assert len(set(manifest["rank_state_digests"])) == 1
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert np.max(np.abs(losses - ref_losses) / ref_losses) > 1e-7  # the compression really ran
