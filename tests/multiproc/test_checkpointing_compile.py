"""Activation checkpointing and torch.compile keep the training: one process (``local``), 2 ranks (DDP, ZeRO-3, FSDP2).

The zoo's transformer LM on token data, fp32, SGD with momentum, a cosine decay, 2 micro-steps of
accumulation and clipping that bites, 22 steps (each layout's runs in turn in one launch, as ``polytrain
train`` runs them: `procs.trained_runs`; 2 ranks under torchrun over gloo on loopback). Against the same run eager and without checkpointing:

- ``activation_checkpointing: true``: per-step losses and final weights within 1e-5 relative (they
  come out equal: the recomputation replays the forward, dropout's RNG state included — the runs use
  dropout 0.1 so that replay is tested);
- ``compile.enabled: true``: within 1e-4 (inductor's fused kernels round differently: ~1e-7 on losses,
  a few 1e-6 on weights) and not bit-identical, the sign the compiled code ran. Dropout 0 here: compiled
  dropout draws its masks from inductor's own generator, so dropout runs differ by design.
- DDP, FSDP2 (full_shard) and ZeRO-3 also run compile and checkpointing together, against the eager
  DDP run (the sharded backends train like DDP within 1e-5: test_sharded_parity.py).

Compiling on CPU builds C++ with g++ (inductor); a cold compile of this model takes 20-60 s per run on
a loaded 2-core machine, the inductor cache (``/tmp/torchinductor_<user>``) makes later runs seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from procs import trained_runs
from specs import PARITY_TRAINING, TOKENS, as_sets, lm, merged

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]  # a layout's first test trains all its runs

# 640 sequences: 512 for training, 16 steps of 32 an epoch (no partial batch to compile a second time)
LM = as_sets(merged(lm(tokens={**TOKENS, "samples": 640}), PARITY_TRAINING))
STEPS = 22
DROPOUT, NO_DROPOUT = ["model.params.dropout=0.1"], ["model.params.dropout=0.0"]
CHECKPOINTING, COMPILE = ["activation_checkpointing=true"], ["compile.enabled=true"]
LAYOUTS = {"local": (1, ["backend=local", "data.batch_size=16"]), "ddp": (2, ["backend=ddp", "data.batch_size=8"]),
           "fsdp": (2, ["backend=fsdp", "data.batch_size=8"]),
           "zero3": (2, ["backend=deepspeed", "deepspeed.stage=3", "data.batch_size=8"])}

pytestmark.append(pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                     reason="torch.compile on CPU needs a C++ compiler"))


#: each layout's runs, all in one launch (`procs.trained_runs`): eager and checkpointed with dropout; eager
#: without dropout (the compiled runs' reference: local's for local, DDP's for the 2-rank layouts); compiled
#: (with checkpointing on 2 ranks)
RUNS = {
    "local": {"eager": DROPOUT, "checkpointing": [*DROPOUT, *CHECKPOINTING], "eager-no-dropout": NO_DROPOUT,
              "compiled": [*NO_DROPOUT, *COMPILE]},
    "ddp": {"eager": DROPOUT, "checkpointing": [*DROPOUT, *CHECKPOINTING], "eager-no-dropout": NO_DROPOUT,
            "compiled": [*NO_DROPOUT, *COMPILE, *CHECKPOINTING]},
    "zero3": {"eager": DROPOUT, "checkpointing": [*DROPOUT, *CHECKPOINTING],
              "compiled": [*NO_DROPOUT, *COMPILE, *CHECKPOINTING]},
    "fsdp": {"compiled": [*NO_DROPOUT, *COMPILE, *CHECKPOINTING]},
}


class Runs:
    """Each layout's runs (`RUNS`), trained in one launch on first use and kept for the module."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}

    def __getitem__(self, layout: str) -> dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]:
        if layout not in self.done:
            nproc, backend = LAYOUTS[layout]
            runs = trained_runs(self.root / layout, nproc, {name: ([*backend, *changes], None)
                                                            for name, changes in RUNS[layout].items()}, LM)
            self.done[layout] = {}
            for name, run in runs.items():
                assert not run.left_behind, run.left_behind
                assert len(run.losses) == STEPS and run.manifest["world_size"] == nproc
                assert run.manifest["backend"] == next(a.partition("=")[2] for a in backend
                                                       if a.startswith("backend="))
                self.done[layout][name] = (run.losses, run.state)
        return self.done[layout]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))


def differences(run: tuple, ref: tuple) -> tuple[float, float]:
    """Largest relative difference of the per-step losses, and of any weight tensor (relative to its largest
    magnitude)."""
    (losses, state), (ref_losses, ref_state) = run, ref
    assert set(state) == set(ref_state)  # the plain model's names: no wrapper prefixes
    loss_rel = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    weight_rel = max(float(np.max(np.abs(state[k] - ref_state[k])) / np.max(np.abs(ref_state[k])))
                     for k in ref_state)
    return loss_rel, weight_rel


@pytest.mark.parametrize("layout", ["local", "ddp", "zero3"])  # fsdp: test_sharded_parity.py (the alias)
def test_checkpointing_keeps_the_run(layout: str, runs: Runs) -> None:
    ref, ours = runs[layout]["eager"], runs[layout]["checkpointing"]
    loss_rel, weight_rel = differences(ours, ref)
    print(f"\n{layout} checkpointing: losses within {loss_rel:.1e}, weights within {weight_rel:.1e}")
    assert loss_rel < 1e-5 and weight_rel < 1e-5
    assert ref[0][-1] < ref[0][0] - 0.1  # it learned something


# compiled DDP alone is in ddp+checkpointing (a run of both); local covers compile without checkpointing
@pytest.mark.parametrize("layout", ["local", "ddp", "fsdp", "zero3"],
                         ids=["local", "ddp+checkpointing", "fsdp+checkpointing", "zero3+checkpointing"])
def test_compile_keeps_the_run(layout: str, runs: Runs) -> None:
    """Against the eager run without dropout: local's own, and 2 DDP ranks' for the 2-rank layouts (FSDP and
    ZeRO-3 train like it: tests/multiproc/test_sharded_parity.py)."""
    ref = runs["local" if layout == "local" else "ddp"]["eager-no-dropout"]
    ours = runs[layout]["compiled"]
    loss_rel, weight_rel = differences(ours, ref)
    print(f"\n{layout} compile{' + checkpointing' if layout != 'local' else ''}: losses within {loss_rel:.1e}, "
          f"weights within {weight_rel:.1e}")
    assert loss_rel < 1e-4 and weight_rel < 1e-4
    assert weight_rel > 0, "bit-identical to eager: the compiled code did not run"
    assert ref[0][-1] < ref[0][0] - 0.1
