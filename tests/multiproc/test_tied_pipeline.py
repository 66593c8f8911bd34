"""The zoo transformer's default, a tied input embedding and output head, under pipeline parallel (issue 32
item 1), with real processes under torchrun (gloo on loopback).

The first stage holds the embedding, the last stage a copy of it as the head; the two copies' gradients are
summed every step, so both take the one weight's update. The job is test_model_parallel's parity job (SGD with
momentum, clipping that bites — a tied gradient counted twice in the norm would show —, 2 micro-steps of
accumulation, 22 steps, a checkpoint at step 11) on the tied LM. Each layout matches one process within 1e-5:
P=2, P=4 (the two copies' ranks in a group of their own), P=2 × T=2, the zero-bubble schedules and the full grid
P=2 × T=2 × D=2 over FSDP at 8 ranks (item 4) straight through; the grid's checkpoint resumed by one process and
at D=4; P=2 × D=2 with FSDP as the data dimension resumed from the one-process
checkpoint; one process resumed from the P=2 checkpoint. The P=2 checkpoint is the one process's in form: the same names, the embedding and the head equal
to the bit, the optimizer state once, under the embedding's name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from procs import one_model_on_every_rank, trained_runs
from safetensors.numpy import load_file
from specs import PARITY_TRAINING, TOKENS, as_sets, lm, merged

from polytrain.checkpoint.store import step_dir_name

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

TIED = as_sets(merged(lm(tokens={**TOKENS, "samples": 640}, n_layers=4, tie_weights=True, dropout=0.0),
                      PARITY_TRAINING, {"optimizer": {"lr": 0.5}, "schedule": None,
                                        "data": {"global_batch_size": 32}, "checkpoint": {"every_n_steps": 11}}))
STEPS, SAVED = 22, 11
P2 = ["backend=ddp", "parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.microbatches=4"]
P2T2 = ["backend=ddp", "parallel.pipeline=2", "parallel.tensor=2"]
P4 = ["backend=ddp", "parallel.pipeline=4", "parallel.microbatches=4"]
#: the zero-bubble family (issue 32 item 2) at P=2: ZBV and DualPipeV put stages 0 and 3 on rank 0, so the tied
#: weight is one Parameter there; ZBV with 2 micro-batches (fewer than its 2P − 1) runs its V-shaped fallback
SCHEDULES = {name: ["backend=ddp", "parallel.pipeline=2", f"parallel.schedule={schedule}", f"parallel.microbatches={m}"]
             for name, schedule, m in (("interleaved_zero_bubble", "interleaved_zero_bubble", 4), ("zbv", "zbv", 4),
                                       ("dualpipev", "dualpipev", 4), ("zbv-fallback", "zbv", 2))}
P2D2_FSDP = ["backend=fsdp", "parallel.pipeline=2"]
GRID = ["backend=fsdp", "parallel.pipeline=2", "parallel.tensor=2"]  # at 8 ranks: data 2


def within(losses: np.ndarray, state: dict, ref_losses: np.ndarray, ref_state: dict) -> tuple[float, float]:
    assert set(state) == set(ref_state)
    np.testing.assert_array_equal(state["head.weight"], state["tok_emb.weight"])  # still one weight
    loss_rel = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    weight_rel = max(float(np.max(np.abs(state[k] - ref_state[k])) / np.max(np.abs(ref_state[k])))
                     for k in ref_state)
    return loss_rel, weight_rel


def saved(out: Path) -> Path:
    return out / "checkpoints" / step_dir_name(SAVED)


def optimizer_file(out: Path) -> dict[str, np.ndarray]:
    return load_file(str(saved(out) / "optimizer.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray, dict]]:
    """Every run of the file, one launch per world size in the order their checkpoints need
    (`procs.trained_runs`): at 2 ranks P=2 and the zero-bubble schedules; the grid at 8; one process straight
    through, then resuming P=2's and the grid's; at 4 ranks P=2 × T=2, P=4 and the resumes of the one process's
    checkpoint at P=2 × D=2 over FSDP and of the grid's at D=4. Every run left no process and ended with the
    same full model on every rank (`procs.one_model_on_every_rank`)."""
    root = tmp_path_factory.mktemp("tied")
    done: dict[str, tuple[Path, np.ndarray, dict]] = {}
    plans = (
        (2, lambda: {"p2": (P2, None), **{name: (sets, None) for name, sets in SCHEDULES.items()}}),
        (8, lambda: {"grid": (GRID, None)}),
        (1, lambda: {"one": (["backend=ddp"], None), "one-from-p2": (["backend=ddp"], saved(root / "p2")),
                     "one-from-grid": (["backend=ddp"], saved(root / "grid"))}),
        (4, lambda: {"p2t2": (P2T2, None), "p4": (P4, None), "p2d2-fsdp-from-one": (P2D2_FSDP, saved(root / "one")),
                     "fsdp-d4-from-grid": (["backend=fsdp"], saved(root / "grid"))}),
    )
    for nproc, plan in plans:
        plan = plan()
        for name, run in trained_runs(root, nproc, plan, TIED).items():
            one_model_on_every_rank(run, nproc, " ".join(plan[name][0]))
            done[name] = (root / name, run.losses, run.state)
    return done


def test_a_tied_model_trains_at_pipeline2_like_one_process(runs: dict) -> None:
    _, ref_losses, ref_state = runs["one"]
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learned something
    out, losses, state = runs["p2"]
    loss_rel, weight_rel = within(losses, state, ref_losses, ref_state)
    print(f"\ntied pipeline2: losses within {loss_rel:.1e}, weights within {weight_rel:.1e}")
    assert loss_rel < 1e-5 and weight_rel < 1e-5
    # the checkpoint in the one process's form: its model tensors and its optimizer state's names
    one, p2 = (load_file(str(saved(run) / "model.safetensors")) for run in (runs["one"][0], out))
    assert sorted(p2) == sorted(one)
    np.testing.assert_array_equal(p2["head.weight"], p2["tok_emb.weight"])
    assert sorted(optimizer_file(out)) == sorted(optimizer_file(runs["one"][0]))
    assert not any(key.startswith("head.weight/") for key in optimizer_file(out))


@pytest.mark.parametrize("layout", ["p2t2", "p4", "grid", *SCHEDULES])
def test_a_tied_model_trains_in_each_layout_like_one_process(layout: str, runs: dict) -> None:
    _, ref_losses, ref_state = runs["one"]
    _, losses, state = runs[layout]
    loss_rel, weight_rel = within(losses, state, ref_losses, ref_state)
    print(f"\ntied {layout}: losses within {loss_rel:.1e}, weights within {weight_rel:.1e}")
    assert loss_rel < 1e-5 and weight_rel < 1e-5


def test_the_one_process_checkpoint_resumes_tied_at_pipeline2_over_fsdp(runs: dict) -> None:
    _, ref_losses, ref_state = runs["one"]
    _, losses, state = runs["p2d2-fsdp-from-one"]
    assert len(losses) == STEPS - SAVED
    loss_rel, weight_rel = within(losses, state, ref_losses[SAVED:], ref_state)
    print(f"\ntied fsdp × pipeline2 (resumed): losses within {loss_rel:.1e}, weights within {weight_rel:.1e}")
    assert loss_rel < 1e-5 and weight_rel < 1e-5


def test_the_pipeline2_checkpoint_resumes_tied_on_one_process(runs: dict) -> None:
    _, ref_losses, ref_state = runs["one"]
    _, losses, state = runs["one-from-p2"]
    loss_rel, weight_rel = within(losses, state, ref_losses[SAVED:], ref_state)
    assert loss_rel < 1e-5 and weight_rel < 1e-5


@pytest.mark.parametrize("resumed", ["one-from-grid", "fsdp-d4-from-grid"], ids=["one", "fsdp-d4"])
def test_the_full_grid_checkpoint_resumes_on_one_process_and_at_d4(resumed: str, runs: dict) -> None:
    _, ref_losses, ref_state = runs["one"]
    _, losses, state = runs[resumed]
    assert len(losses) == STEPS - SAVED
    loss_rel, weight_rel = within(losses, state, ref_losses[SAVED:], ref_state)
    assert loss_rel < 1e-5 and weight_rel < 1e-5
