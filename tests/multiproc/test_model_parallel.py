"""Tensor, pipeline and hybrid parallel train like one process (issue 18), with real processes.

The zoo transformer LM (4 blocks, 4 heads, untied head), fp32, SGD with momentum (Adam would turn the
rounding noise of gradients that are truly zero — the key bias's — into full-size steps), clipping that
bites, 2 micro-steps of accumulation, a global batch of 32 in every layout (so every layout takes the same
steps), 22 steps, dropout 0. Each layout trains under torchrun (gloo on loopback; the layouts of one world
size in turn in one launch, as ``polytrain train`` runs them: `procs.trained_runs`) and must match one
process (``backend: ddp`` at world size 1): per-step losses and final weights within 1e-5 relative
(``compile`` within 1e-4 and not bit-identical), every rank holding the same full weights (the portable
form gathers tensor shards and pipeline stages), the plain model's parameter names.

Resume contract (docs/portable-state.md, "Model-parallel layouts"): a checkpoint holds full tensors, so a
T=2 run's step-11 checkpoint resumed by one process, and the one-process run's resumed at P=2 × T=2,
both end on the straight run's final weights and losses (same global batch; dropout 0, so the RNG streams,
which are per layout, do not matter).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from procs import check, one_model_on_every_rank, step_losses, train, trained_run, trained_runs
from specs import PARITY_TRAINING, TOKENS, as_sets, lm, merged

from polytrain.checkpoint.store import read_model, step_dir_name

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

# the parity job on a deeper, untied LM, at half the learning rate and without the cosine decay
LM = as_sets(merged(lm(tokens={**TOKENS, "samples": 640}, n_layers=4, tie_weights=False, dropout=0.0), PARITY_TRAINING,
                 {"optimizer": {"lr": 0.5}, "schedule": None, "data": {"global_batch_size": 32},
                  "checkpoint": {"every_n_steps": 11}}))
STEPS, SAVED = 22, 11
LAYOUTS = {
    "tensor2": (2, ["backend=ddp", "parallel.tensor=2"]),
    # cut by hand: 1 block, then 3 (balanced would be 2 and 2)
    "pipeline2-gpipe": (2, ["backend=ddp", "parallel.pipeline=2", "parallel.schedule=gpipe",
                            "parallel.microbatches=4", "parallel.stage_boundaries=[1]"]),
    "pipeline2-1f1b": (2, ["backend=ddp", "parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.microbatches=4"]),
    "pipeline2-interleaved": (2, ["backend=ddp", "parallel.pipeline=2", "parallel.schedule=interleaved_1f1b",
                                  "parallel.microbatches=4"]),
    "tensor2-data2": (4, ["backend=ddp", "parallel.tensor=2"]),
    "pipeline2-tensor2": (4, ["backend=ddp", "parallel.tensor=2", "parallel.pipeline=2"]),
    "fsdp-tensor2": (4, ["backend=fsdp", "parallel.tensor=2"]),
    "tensor2+checkpointing": (2, ["backend=ddp", "parallel.tensor=2", "activation_checkpointing=true"]),
    "fsdp-pipeline2+checkpointing": (2, ["backend=fsdp", "parallel.pipeline=2", "activation_checkpointing=true"]),
}


def trained(out: Path, nproc: int, changes: list[str], resume: Path | None = None) -> tuple[np.ndarray, dict, dict]:
    run = trained_run(out, [*LM, *changes], nproc=nproc, resume=resume, timeout=600)
    one_model_on_every_rank(run, nproc, " ".join(changes))
    return run.losses, run.state, run.manifest


def differences(losses: np.ndarray, state: dict, ref_losses: np.ndarray, ref_state: dict) -> tuple[float, float]:
    assert set(state) == set(ref_state)  # the plain model's names, every stage's parameters
    loss_rel = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    weight_rel = max(float(np.max(np.abs(state[k] - ref_state[k])) / np.max(np.abs(ref_state[k])))
                     for k in ref_state)
    return loss_rel, weight_rel


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, dict]:
    out = tmp_path_factory.mktemp("one-process")
    losses, state, _ = trained(out, 1, ["backend=ddp"])
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.1  # it learned something
    return out, losses, state


RESUMED_AT_P2T2 = "one-process-resumed-at-pipeline2-tensor2"


@pytest.fixture(scope="module")
def layout_runs(one_process: tuple, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Every layout's run, one launch per world size (`procs.trained_runs`): the 2-rank layouts, then the 4-rank
    ones with the one-process run's step-11 checkpoint resumed at P=2 × T=2; each checked as
    `trained` checks one."""
    root = tmp_path_factory.mktemp("layouts")
    plans: dict[int, dict[str, tuple[list[str], Path | None]]] = {}
    for name, (nproc, changes) in LAYOUTS.items():
        plans.setdefault(nproc, {})[name] = (changes, None)
    plans[4][RESUMED_AT_P2T2] = (LAYOUTS["pipeline2-tensor2"][1], _saved(one_process[0]))
    runs = {}
    for nproc, plan in plans.items():
        for name, run in trained_runs(root, nproc, plan, LM).items():
            one_model_on_every_rank(run, nproc, " ".join(plan[name][0]))
            runs[name] = (root / name, run.losses, run.state, run.manifest)
    return runs


@pytest.fixture(scope="module")
def tensor2_run(layout_runs: dict) -> tuple[Path, np.ndarray, dict]:
    out, losses, state, _ = layout_runs["tensor2"]
    return out, losses, state


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_process(layout: str, one_process: tuple, layout_runs: dict) -> None:
    _, ref_losses, ref_state = one_process
    _, losses, state, manifest = layout_runs[layout]
    assert manifest["backend"] == LAYOUTS[layout][1][0].partition("=")[2]
    loss_rel, weight_rel = differences(losses, state, ref_losses, ref_state)
    print(f"\n{layout}: losses within {loss_rel:.1e}, weights within {weight_rel:.1e}")
    assert loss_rel < 1e-5 and weight_rel < 1e-5


def test_compile_keeps_tensor_parallel(one_process: tuple, tmp_path: Path) -> None:
    _, ref_losses, ref_state = one_process
    losses, state, _ = trained(tmp_path, 2, ["backend=ddp", "parallel.tensor=2", "compile.enabled=true"])
    loss_rel, weight_rel = differences(losses, state, ref_losses, ref_state)
    print(f"\ntensor2 + compile: losses within {loss_rel:.1e}, weights within {weight_rel:.1e}")
    assert loss_rel < 1e-4 and weight_rel < 1e-4
    assert weight_rel > 0, "bit-identical to eager: the compiled code did not run"


def _saved(out: Path) -> Path:
    return out / "checkpoints" / step_dir_name(SAVED)


def test_tensor_parallel_checkpoint_resumes_on_one_process(one_process: tuple, tensor2_run: tuple,
                                                           tmp_path: Path) -> None:
    _, ref_losses, ref_state = one_process
    source, _, _ = tensor2_run
    losses, state, _ = trained(tmp_path, 1, ["backend=ddp"], resume=_saved(source))
    loss_rel, weight_rel = differences(losses, state, ref_losses[SAVED:], ref_state)
    assert len(losses) == STEPS - SAVED
    assert loss_rel < 1e-5 and weight_rel < 1e-5


def test_one_process_checkpoint_resumes_at_pipeline2_tensor2(one_process: tuple, layout_runs: dict) -> None:
    _, ref_losses, ref_state = one_process
    _, losses, state, _ = layout_runs[RESUMED_AT_P2T2]
    loss_rel, weight_rel = differences(losses, state, ref_losses[SAVED:], ref_state)
    assert len(losses) == STEPS - SAVED
    assert loss_rel < 1e-5 and weight_rel < 1e-5


USER = ["model.name=tp_user_model:make", "data.name=digits", "optimizer.name=sgd", "optimizer.lr=0.1",
        "optimizer.momentum=0.9", "loop.epochs=1", "loop.max_steps=20", "loop.log_every_n_steps=1",
        "data.global_batch_size=32"]
HERE = Path(__file__).resolve().parent


def train_user(out: Path, nproc: int, changes: list[str], *, timeline: Path | None = None, probe: Path | None = None):
    args = ["--timeline", str(timeline)] if timeline is not None else []
    env = {"PYTHONPATH": str(HERE), **({"PROBE_DIR": str(probe)} if probe else {})}
    return train(out, [*USER, *changes], nproc=nproc, args=args, env=env, timeout=400)


def user_result(out: Path) -> tuple[np.ndarray, dict]:
    state, manifest = read_model(out)
    assert len(set(manifest["rank_state_digests"])) == 1
    return step_losses(out), state


@pytest.fixture(scope="module")
def user_one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, dict]:
    out = tmp_path_factory.mktemp("user-one-process")
    check(train_user(out, 1, ["backend=ddp"]))
    return user_result(out)


def test_a_user_model_with_its_own_plan_and_a_pipeline_timeline(user_one_process: tuple, tmp_path: Path) -> None:
    """``parallel.tensor_plan`` splits a user's model; the same model cut into 2 pipeline stages shows each
    stage's forward and backward per micro-batch, and the bubbles, on the timeline."""
    ref_losses, ref_state = user_one_process
    check(train_user(tmp_path / "tp", 2, ["backend=ddp", "parallel.tensor=2", "parallel.tensor_plan=tp_user_model:plan"]))
    losses, state = user_result(tmp_path / "tp")
    loss_rel, weight_rel = differences(losses, state, ref_losses, ref_state)
    assert loss_rel < 1e-5 and weight_rel < 1e-5  # each, not the (loss, weight) pair in tuple order
    trace_file = tmp_path / "trace.json"
    check(train_user(tmp_path / "pp", 2, ["backend=ddp", "parallel.pipeline=2", "parallel.microbatches=4"],
                     timeline=trace_file))
    losses, state = user_result(tmp_path / "pp")
    loss_rel, weight_rel = differences(losses, state, ref_losses, ref_state)
    assert loss_rel < 1e-5 and weight_rel < 1e-5
    events = json.loads(trace_file.read_text())["traceEvents"]
    stage_events = [e for e in events if e.get("cat") == "pipeline" and e["name"] in ("forward", "backward")]
    for rank in (0, 1):  # one stage per rank, 4 micro-batches a step, forward and backward of each
        mine = [e for e in stage_events if e["pid"] == rank]
        assert {e["args"]["stage"] for e in mine} == {rank}
        for name in ("forward", "backward"):
            micro = [e["args"]["micro"] for e in mine if e["name"] == name]
            assert len(micro) >= 20 * 4 and set(micro) == {0, 1, 2, 3}
        backwards = sum(e["name"] == "backward" for e in mine)
        assert backwards == 20 * 4  # training only: validation runs forward only
    bubbles = [e for e in events if e.get("cat") == "pipeline" and e["name"] == "bubble"]
    assert {e["pid"] for e in bubbles} == {0, 1} and all(e["dur"] > 0 for e in bubbles)


def test_a_plan_naming_a_missing_module_is_one_line(tmp_path: Path) -> None:
    result = train_user(tmp_path, 2, ["backend=ddp", "parallel.tensor=2",
                                      "parallel.tensor_plan=tp_user_model:broken_plan"])
    assert result.returncode != 0
    assert "adapters/torch" not in result.stderr  # no rank's traceback (torchrun prints its own)
    errors = {line for line in result.stderr.splitlines() if line.startswith("polytrain: error:")}
    assert errors == {"polytrain: error: parallel.tensor_plan: no submodule 'layers.0.gate' in ResidualMLP (the plan "
                      "names 1 missing module(s)); use names from model.named_modules()"}, result.stderr[-2000:]
    assert not result.left_behind


PLAN = ["backend=fsdp", "parallel.tensor=2", "parallel.tensor_plan=tp_user_model:plan", "model.name=tp_user_model:make_probed"]
#: the fsdp table under parallel (issue 26 item 7): (processes, settings, what the probe must find on every rank,
#: whether the run must match one process). The probe (tp_user_model.ProbedResidualMLP) reads the first block
#: after its forward: a weight left gathered has the tensor mesh only, a resharded one the data dimensions too.
FSDP_TABLE = {
    "shard_grad_op+cpu_offload": (2, ["fsdp.sharding=shard_grad_op", "fsdp.cpu_offload=true"], {
        "registered_after_forward": ["tp"], "data_mesh": {"dp_shard": 1}, "offload": True,
        "param_dtype": "None", "reduce_dtype": "None"}, True),
    "no_shard over 2 data ranks": (4, ["fsdp.sharding=no_shard"], {
        "registered_after_forward": ["tp"], "data_mesh": {"dp_replicate": 2, "dp_shard": 1}, "offload": False}, True),
    "hybrid_shard+bf16, reduce in bf16": (2, ["fsdp.sharding=hybrid_shard", "precision=bf16", "fsdp.reduce_fp32=false"], {
        "registered_after_forward": ["dp_replicate", "dp_shard", "tp"], "registered_dtype": "torch.float32",
        "data_mesh": {"dp_replicate": 1, "dp_shard": 1}, "offload": False,
        "param_dtype": "torch.bfloat16", "reduce_dtype": "torch.bfloat16"}, False),
}


@pytest.mark.parametrize("case", list(FSDP_TABLE))
def test_the_fsdp_table_applies_on_the_data_dimension(case: str, user_one_process: tuple, tmp_path: Path) -> None:
    """fsdp.sharding, cpu_offload and reduce_fp32 under parallel go through plain fsdp's options: each one's
    effect is seen on every rank, and the fp32 runs still train like one process."""
    nproc, sets, expected, parity = FSDP_TABLE[case]
    probe = tmp_path / "probe"
    probe.mkdir()
    check(train_user(tmp_path / "run", nproc, [*PLAN, *sets], probe=probe))
    records = [json.loads((probe / f"rank-{rank}.json").read_text()) for rank in range(nproc)]
    for record in records:
        assert {key: record[key] for key in expected} == expected, record
    losses, state = user_result(tmp_path / "run")
    if parity:
        loss_rel, weight_rel = differences(losses, state, *user_one_process)
        assert loss_rel < 1e-5 and weight_rel < 1e-5
    else:
        assert all(np.isfinite(v).all() for v in state.values()) and losses[-1] < losses[0]


@pytest.mark.parametrize(("sets", "line"), [
    (["parallel.pipeline=2", "model.params.depth=1"],
     "parallel.pipeline: 2 stages need at least 2 blocks; the model declares 1 (ResidualMLP's block_classes); use "
     "fewer stages or a deeper model"),
    (["parallel.pipeline=2", "parallel.stage_boundaries=[4]"],
     "parallel.stage_boundaries: [4] cut past the model's 4 blocks (ResidualMLP's block_classes); each boundary "
     "must be below 4"),
    (["parallel.tensor=2"],
     "parallel.tensor: model ResidualMLP has no tensor-parallel plan built in; give parallel.tensor_plan: "
     "package.module:function returning its parallelize_module plan"),
])
def test_a_factory_model_that_cannot_take_the_layout_stops_every_rank_with_one_line(sets: list[str], line: str,
                                                                                    tmp_path: Path) -> None:
    """A factory's blocks and plan are known only when it is built: every rank stops there with the line a zoo
    model gets at spec time."""
    result = train_user(tmp_path, 2, ["backend=ddp", *sets])
    assert result.returncode != 0
    assert "adapters/torch" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("polytrain: error:")]
    assert set(errors) == {f"polytrain: error: {line}"}, result.stderr[-2000:]
    assert not result.left_behind
