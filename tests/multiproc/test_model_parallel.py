"""Tensor, pipeline and hybrid parallel train like one process (issue 18), with real processes.

The zoo transformer LM (4 blocks, 4 heads, untied head), fp32, SGD with momentum (Adam would turn the
rounding noise of gradients that are truly zero — the key bias's — into full-size steps), clipping that
bites, 2 micro-steps of accumulation, a global batch of 32 in every layout (so every layout takes the same
steps), 22 steps, dropout 0. Each layout trains under torchrun (gloo on loopback) and must match one
process (``backend: ddp`` at world size 1): per-step losses and final weights within 1e-5 relative
(``compile`` within 1e-4 and not bit-identical), every rank holding the same full weights (the portable
form gathers tensor shards and pipeline stages), the plain model's parameter names.

Resume contract (docs/portable-state.md, "Model-parallel layouts"): a checkpoint holds full tensors, so a
T=2 run's step-11 checkpoint resumed by one process, and the one-process run's resumed at P=2 × T=2,
both end on the straight run's final weights and losses (same global batch; dropout 0, so the RNG streams,
which are per layout, do not matter).

Launches: a rank costs seconds of CPU before it trains (torch, the agent), so every ``polytrain train`` command
line of the file runs in one launch per world size (cli_runs_worker.py: each rank runs the CLI's ``main`` on each
command line in turn, its output and exit code kept per command line), the ones that must fail included: the
2-rank one first (its T=2 checkpoint is resumed by one process), then the one-process one, then the 4-rank one
(it resumes the one process's checkpoint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import Trained, check, command, job_env, one_model_on_every_rank, run, set_args, step_losses
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
COMPILED, COMPILE = "tensor2+compile", ["backend=ddp", "parallel.tensor=2", "compile.enabled=true"]
RESUMED_AT_P2T2 = "one-process-resumed-at-pipeline2-tensor2"
HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "cli_runs_worker.py")


# ------------------------------------------------------------------------------ the launches

@dataclass
class Ran:
    """One command line of a launch (`launch`): its output directory, every rank's exit code (what ``polytrain
    train`` would have exited with) and stderr, and what the launch left running (`procs.run`'s ``left_behind``)."""

    out: Path
    codes: list[int]
    errs: list[str]
    left_behind: list[str]


def job(sets: list[str], *, resume: Path | None = None, args: tuple[str, ...] = (),
        env: dict[str, str] | None = None) -> dict[str, Any]:
    return {"sets": sets, "resume": resume, "args": args, "env": env or {}}


def launch(root: Path, nproc: int, jobs: dict[str, dict[str, Any]], timeout: float = 800) -> dict[str, Ran]:
    """Each of ``jobs`` (name: `job`) as ``polytrain train --quiet --set output=ROOT/NAME --set SETS... [--resume R]
    ARGS...`` (the command line `procs.train` builds), in turn on the same ``nproc`` ranks in one launch of
    cli_runs_worker.py (torchrun; one process without a launcher), tp_user_model importable."""
    runs = [{"argv": ["train", "--quiet", *set_args([f"output={root / name}", *j["sets"]]),
                      *(["--resume", str(j["resume"])] if j["resume"] is not None else []), *j["args"]],
             "env": j["env"], "log": str(root / "logs" / name)} for name, j in jobs.items()]
    done = check(run(command("python" if nproc == 1 else "torchrun", [WORKER, json.dumps({"runs": runs})], nproc),
                     env=job_env({"PYTHONPATH": str(HERE)}), timeout=timeout))
    logs = {name: root / "logs" / name for name in jobs}
    return {name: Ran(root / name, [int((log / f"rank-{r}.code").read_text()) for r in range(nproc)],
                      [(log / f"rank-{r}.err").read_text() for r in range(nproc)], done.left_behind)
            for name, log in logs.items()}


def succeeded(ran: Ran) -> Ran:
    assert ran.codes == [0] * len(ran.codes), f"exit codes {ran.codes}\n" + "\n".join(e[-4000:] for e in ran.errs)
    return ran


def trained(ran: Ran, label: str) -> Trained:
    """The run, which must have succeeded on every rank (`procs.trained_run`), checked by
    `procs.one_model_on_every_rank`."""
    state, manifest = read_model(succeeded(ran).out)
    result = Trained(step_losses(ran.out), state, manifest, "", ran.left_behind)
    one_model_on_every_rank(result, len(ran.codes), label)
    return result


def stops_every_rank_with_one_line(ran: Ran, line: str) -> None:
    shown = "\n".join(err[-2000:] for err in ran.errs)
    assert all(code != 0 for code in ran.codes), (ran.codes, shown)
    assert not any("adapters/torch" in err for err in ran.errs), shown  # no rank's traceback
    errors = {text for err in ran.errs for text in err.splitlines() if text.startswith("polytrain: error:")}
    assert errors == {f"polytrain: error: {line}"}, shown
    assert all(f"polytrain: error: {line}" in err.splitlines() for err in ran.errs), shown  # each rank's own
    assert not ran.left_behind


USER = ["model.name=tp_user_model:make", "data.name=digits", "optimizer.name=sgd", "optimizer.lr=0.1",
        "optimizer.momentum=0.9", "loop.epochs=1", "loop.max_steps=20", "loop.log_every_n_steps=1",
        "data.global_batch_size=32"]
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
FSDP_RUNS = {case: f"fsdp-{i}" for i, case in enumerate(FSDP_TABLE)}  # the run's name, its probe's folder PROBE-NAME
MISSING_MODULE = (["parallel.tensor=2", "parallel.tensor_plan=tp_user_model:broken_plan"],
                  "parallel.tensor_plan: no submodule 'layers.0.gate' in ResidualMLP (the plan names 1 missing "
                  "module(s)); use names from model.named_modules()")
#: a factory model that cannot take the layout: its settings and the line every rank stops with
FACTORY_MISFITS = {
    "one-block-two-stages": (["parallel.pipeline=2", "model.params.depth=1"],
                             "parallel.pipeline: 2 stages need at least 2 blocks; the model declares 1 (ResidualMLP's "
                             "block_classes); use fewer stages or a deeper model"),
    "boundary-past-the-blocks": (["parallel.pipeline=2", "parallel.stage_boundaries=[4]"],
                                 "parallel.stage_boundaries: [4] cut past the model's 4 blocks (ResidualMLP's "
                                 "block_classes); each boundary must be below 4"),
    "no-plan-built-in": (["parallel.tensor=2"],
                         "parallel.tensor: model ResidualMLP has no tensor-parallel plan built in; give "
                         "parallel.tensor_plan: package.module:function returning its parallelize_module plan"),
}
TRACE = "trace.json"  # the pipeline user run's timeline, beside its output


def layout_jobs(nproc: int) -> dict[str, dict[str, Any]]:
    return {name: job([*LM, *changes]) for name, (n, changes) in LAYOUTS.items() if n == nproc}


def fsdp_jobs(root: Path, nproc: int) -> dict[str, dict[str, Any]]:
    jobs = {}
    for case, (n, sets, _, _) in FSDP_TABLE.items():
        if n == nproc:
            probe = root / f"probe-{FSDP_RUNS[case]}"
            probe.mkdir()
            jobs[FSDP_RUNS[case]] = job([*USER, *PLAN, *sets], env={"PROBE_DIR": str(probe)})
    return jobs


def _saved(out: Path) -> Path:
    return out / "checkpoints" / step_dir_name(SAVED)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Every 2-rank command line: the layouts, T=2 compiled, the user model's plan, its pipeline with a timeline, the
    fsdp table's 2-rank rows; last the ones that must stop at set-up."""
    root = tmp_path_factory.mktemp("two-ranks")
    jobs = {**layout_jobs(2), COMPILED: job([*LM, *COMPILE]),
            "user-tp": job([*USER, "backend=ddp", "parallel.tensor=2", "parallel.tensor_plan=tp_user_model:plan"]),
            "user-pp": job([*USER, "backend=ddp", "parallel.pipeline=2", "parallel.microbatches=4"],
                           args=("--timeline", str(root / TRACE))),
            **fsdp_jobs(root, 2), "missing-module": job([*USER, "backend=ddp", *MISSING_MODULE[0]]),
            **{name: job([*USER, "backend=ddp", *sets]) for name, (sets, _) in FACTORY_MISFITS.items()}}
    return launch(root, 2, jobs)


@pytest.fixture(scope="module")
def one_rank(two_ranks: dict[str, Ran], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """The one-process references (the LM and the user model) and the T=2 step-11 checkpoint resumed."""
    return launch(tmp_path_factory.mktemp("one-rank"), 1, {
        "one-process": job([*LM, "backend=ddp"]), "user-one-process": job([*USER, "backend=ddp"]),
        "tensor2-resumed": job([*LM, "backend=ddp"], resume=_saved(two_ranks["tensor2"].out))})


@pytest.fixture(scope="module")
def four_ranks(one_rank: dict[str, Ran], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Every 4-rank command line: the layouts, the one process's step-11 checkpoint resumed at P=2 × T=2, the fsdp
    table's 4-rank row."""
    root = tmp_path_factory.mktemp("four-ranks")
    resumed = job([*LM, *LAYOUTS["pipeline2-tensor2"][1]], resume=_saved(one_rank["one-process"].out))
    return launch(root, 4, {**layout_jobs(4), RESUMED_AT_P2T2: resumed, **fsdp_jobs(root, 4)})


# ------------------------------------------------------------------------------ the LM's layouts


def differences(losses: np.ndarray, state: dict, ref_losses: np.ndarray, ref_state: dict) -> tuple[float, float]:
    assert set(state) == set(ref_state)  # the plain model's names, every stage's parameters
    loss_rel = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    weight_rel = max(float(np.max(np.abs(state[k] - ref_state[k])) / np.max(np.abs(ref_state[k])))
                     for k in ref_state)
    return loss_rel, weight_rel


@pytest.fixture(scope="module")
def one_process(one_rank: dict[str, Ran]) -> tuple[np.ndarray, dict]:
    run = trained(one_rank["one-process"], "backend=ddp")
    assert len(run.losses) == STEPS and run.losses[-1] < run.losses[0] - 0.1  # it learned something
    return run.losses, run.state


@pytest.fixture(scope="module")
def layout_runs(two_ranks: dict[str, Ran], four_ranks: dict[str, Ran]) -> dict[str, Ran]:
    return {**two_ranks, **four_ranks}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_process(layout: str, one_process: tuple, layout_runs: dict) -> None:
    ref_losses, ref_state = one_process
    run = trained(layout_runs[layout], " ".join(LAYOUTS[layout][1]))
    assert run.manifest["backend"] == LAYOUTS[layout][1][0].partition("=")[2]
    loss_rel, weight_rel = differences(run.losses, run.state, ref_losses, ref_state)
    print(f"\n{layout}: losses within {loss_rel:.1e}, weights within {weight_rel:.1e}")
    assert loss_rel < 1e-5 and weight_rel < 1e-5


def test_compile_keeps_tensor_parallel(one_process: tuple, two_ranks: dict) -> None:
    ref_losses, ref_state = one_process
    run = trained(two_ranks[COMPILED], " ".join(COMPILE))
    loss_rel, weight_rel = differences(run.losses, run.state, ref_losses, ref_state)
    print(f"\ntensor2 + compile: losses within {loss_rel:.1e}, weights within {weight_rel:.1e}")
    assert loss_rel < 1e-4 and weight_rel < 1e-4
    assert weight_rel > 0, "bit-identical to eager: the compiled code did not run"


def test_tensor_parallel_checkpoint_resumes_on_one_process(one_process: tuple, one_rank: dict) -> None:
    ref_losses, ref_state = one_process
    run = trained(one_rank["tensor2-resumed"], "backend=ddp")
    loss_rel, weight_rel = differences(run.losses, run.state, ref_losses[SAVED:], ref_state)
    assert len(run.losses) == STEPS - SAVED
    assert loss_rel < 1e-5 and weight_rel < 1e-5


def test_one_process_checkpoint_resumes_at_pipeline2_tensor2(one_process: tuple, four_ranks: dict) -> None:
    ref_losses, ref_state = one_process
    run = trained(four_ranks[RESUMED_AT_P2T2], " ".join(LAYOUTS["pipeline2-tensor2"][1]))
    loss_rel, weight_rel = differences(run.losses, run.state, ref_losses[SAVED:], ref_state)
    assert len(run.losses) == STEPS - SAVED
    assert loss_rel < 1e-5 and weight_rel < 1e-5


# ------------------------------------------------------------------------------ a user's model


def user_result(ran: Ran) -> tuple[np.ndarray, dict]:
    state, manifest = read_model(succeeded(ran).out)
    assert len(set(manifest["rank_state_digests"])) == 1
    return step_losses(ran.out), state


@pytest.fixture(scope="module")
def user_one_process(one_rank: dict[str, Ran]) -> tuple[np.ndarray, dict]:
    return user_result(one_rank["user-one-process"])


def test_a_user_model_with_its_own_plan_and_a_pipeline_timeline(user_one_process: tuple, two_ranks: dict) -> None:
    """``parallel.tensor_plan`` splits a user's model; the same model cut into 2 pipeline stages shows each
    stage's forward and backward per micro-batch, and the bubbles, on the timeline."""
    ref_losses, ref_state = user_one_process
    losses, state = user_result(two_ranks["user-tp"])
    loss_rel, weight_rel = differences(losses, state, ref_losses, ref_state)
    assert loss_rel < 1e-5 and weight_rel < 1e-5  # each, not the (loss, weight) pair in tuple order
    losses, state = user_result(two_ranks["user-pp"])
    loss_rel, weight_rel = differences(losses, state, ref_losses, ref_state)
    assert loss_rel < 1e-5 and weight_rel < 1e-5
    events = json.loads((two_ranks["user-pp"].out.parent / TRACE).read_text())["traceEvents"]
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


def test_a_plan_naming_a_missing_module_is_one_line(two_ranks: dict) -> None:
    stops_every_rank_with_one_line(two_ranks["missing-module"], MISSING_MODULE[1])


@pytest.mark.parametrize("case", list(FSDP_TABLE))
def test_the_fsdp_table_applies_on_the_data_dimension(case: str, user_one_process: tuple, two_ranks: dict,
                                                      four_ranks: dict) -> None:
    """fsdp.sharding, cpu_offload and reduce_fp32 under parallel go through plain fsdp's options: each one's
    effect is seen on every rank, and the fp32 runs still train like one process."""
    nproc, _, expected, parity = FSDP_TABLE[case]
    ran = {2: two_ranks, 4: four_ranks}[nproc][FSDP_RUNS[case]]
    losses, state = user_result(ran)
    probe = ran.out.parent / f"probe-{FSDP_RUNS[case]}"
    records = [json.loads((probe / f"rank-{rank}.json").read_text()) for rank in range(nproc)]
    for record in records:
        assert {key: record[key] for key in expected} == expected, record
    if parity:
        loss_rel, weight_rel = differences(losses, state, *user_one_process)
        assert loss_rel < 1e-5 and weight_rel < 1e-5
    else:
        assert all(np.isfinite(v).all() for v in state.values()) and losses[-1] < losses[0]


@pytest.mark.parametrize("case", list(FACTORY_MISFITS))
def test_a_factory_model_that_cannot_take_the_layout_stops_every_rank_with_one_line(case: str, two_ranks: dict) -> None:
    """A factory's blocks and plan are known only when it is built: every rank stops there with the line a zoo
    model gets at spec time."""
    stops_every_rank_with_one_line(two_ranks[case], FACTORY_MISFITS[case][1])
