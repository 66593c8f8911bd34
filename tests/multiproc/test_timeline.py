"""``polytrain train --timeline`` and ``HOROVOD_TIMELINE``: one Chrome trace, one track per rank, with
what each rank did — and the gradient collectives really carry the model's gradients.

Per optimizer step every rank must show forward, backward, the optimizer step and data
events, and gradient-bucket allreduces whose bytes add up to the model's float32 parameter
bytes (4 × the parameter count read back from the run's ``model.safetensors``). Under DDP
the buckets run inside backward (DDP waits for them before backward returns).
"""

from __future__ import annotations

import importlib.util
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from hvd_launch import launch
from procs import check, command, job_env, run, train

from polytrain.checkpoint.store import read_model
from polytrain.horovod.common import _import_error

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

STEPS = 23  # 1 epoch of ceil(1437 / 64)
WORKER = str(Path(__file__).resolve().parent / "traced_worker.py")


def traced(launcher: str, out: Path, sets: list[str], env: Mapping[str, str | None] | None = None,
           exports: Sequence[str] = ()) -> dict:
    """The Chrome trace of one epoch on 2 ranks under ``launcher`` (``--timeline``)."""
    trace = out / "trace.json"
    check(train(out, ["loop.epochs=1", *sets], launcher=launcher, nproc=2, args=["--timeline", str(trace)], env=env,
                exports=exports, timeout=300))
    return json.loads(trace.read_text())


def events(document: dict) -> dict[int, dict[str, list[dict]]]:
    """rank → event name (bucket names folded into 'bucket') → events."""
    out: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in document["traceEvents"]:
        if e["ph"] == "X":
            out[e["pid"]]["bucket" if e["name"].startswith("gradient bucket") else e["name"]].append(e)
    return out


def parameter_bytes(out: Path) -> int:
    state, _ = read_model(out)
    return sum(int(np.asarray(v).size) * 4 for v in state.values())


def assert_every_rank_recorded_training(document: dict, out: Path, loop_events: tuple[str, ...]) -> None:
    by_rank = events(document)
    assert sorted(by_rank) == [0, 1]
    names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank, named in by_rank.items():
        for name in loop_events:
            assert len(named[name]) == STEPS, (rank, name, len(named[name]))
        assert len(named["evaluation"]) == 1
        sent = sum(e["args"]["bytes"] for e in named["bucket"])
        assert sent == STEPS * parameter_bytes(out), (rank, sent)
        assert all(e["args"]["op"] == "allreduce" and e["tid"] == 1 for e in named["bucket"])


#: the 2-rank torchrun runs: each one epoch with --timeline, in turn in ONE torchrun launch (`torchrun_traces`)
TORCHRUN = {"ddp": ["backend=ddp", "checkpoint.every_n_steps=10"],
            "horovod": ["backend=horovod"],  # the shim's (POLYTRAIN_HOROVOD_IMPL=shim for the launch)
            "fsdp": ["backend=fsdp", "fsdp.sharding=full_shard"],
            "zero2": ["backend=deepspeed", "deepspeed.stage=2"],
            "zero3": ["backend=deepspeed", "deepspeed.stage=3"]}


@pytest.fixture(scope="module")
def torchrun_traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, Path]]:
    """Each `TORCHRUN` run's Chrome trace and output folder, from one torchrun launch of ``traced_worker.py``
    (torch's import and the agent once, not five times); DeepSpeed's runs where DeepSpeed imports."""
    root = tmp_path_factory.mktemp("torchrun")
    names = [n for n in TORCHRUN if not n.startswith("zero") or importlib.util.find_spec("deepspeed") is not None]
    runs = [{"sets": [f"output={root / n}", "loop.epochs=1", *TORCHRUN[n]], "timeline": str(root / f"{n}.json")}
            for n in names]
    check(run(command("torchrun", [WORKER, json.dumps({"runs": runs})], 2),
              env=job_env({"POLYTRAIN_HOROVOD_IMPL": "shim"}), timeout=560))
    return {n: (json.loads((root / f"{n}.json").read_text()), root / n) for n in names}


@pytest.mark.timeout(600)
def test_ddp_timeline_under_torchrun(torchrun_traces: dict[str, tuple[dict, Path]]) -> None:
    document, out = torchrun_traces["ddp"]
    assert document["otherData"]["backend"] == "ddp"
    assert_every_rank_recorded_training(document, out, ("data", "micro-step", "forward", "backward", "optimizer step"))
    for rank, named in events(document).items():
        assert len(named["checkpoint"]) == 3  # steps 10, 20 and the final state
        backward = sorted((e["ts"], e["ts"] + e["dur"]) for e in named["backward"])
        for bucket in named["bucket"]:  # each bucket's allreduce happens within one backward pass
            assert any(start - 1 <= bucket["ts"] and bucket["ts"] + bucket["dur"] <= end + 1000
                       for start, end in backward), (rank, bucket)


@pytest.mark.timeout(600)
def test_horovod_backend_timeline_records_the_shims_buckets(torchrun_traces: dict[str, tuple[dict, Path]]) -> None:
    document, out = torchrun_traces["horovod"]
    assert_every_rank_recorded_training(document, out, ("forward", "backward", "synchronize gradients"))


def test_mpi_backend_timeline_under_mpirun_torch_and_tensorflow(tmp_path: Path) -> None:
    env = {"POLYTRAIN_MPI_FUSION_BYTES": "16384"}  # several buckets per step
    for framework in ("torch", "tensorflow"):
        if framework == "tensorflow":
            pytest.importorskip("tensorflow")
        out = tmp_path / framework
        document = traced("mpirun", out, [f"framework={framework}", "backend=mpi"], env=env, exports=list(env))
        assert_every_rank_recorded_training(document, out, ("data", "micro-step", "optimizer step"))
        assert len(events(document)[0]["bucket"]) > STEPS  # fused into more than one bucket per step


@pytest.mark.parametrize("backend", ["tf-multiworker", "horovod"])
def test_tensorflow_graph_collective_backends_record_each_bucket(tmp_path: Path, backend: str) -> None:
    """tf-multiworker's strategy and Horovod's TF ops reduce after the compiled micro-step, one
    compiled call per bucket: each is on the timeline with its bytes."""
    pytest.importorskip("tensorflow")
    if backend == "horovod" and _import_error("horovod.tensorflow") is not None:
        pytest.skip("Horovod's TensorFlow ops are not built here")
    env = {"POLYTRAIN_MPI_FUSION_BYTES": "16384"}  # several buckets per step
    sets = ["framework=tensorflow", f"backend={backend}"]
    if backend == "horovod":
        document = traced("mpirun", tmp_path, sets, env={**env, "MASTER_ADDR": None}, exports=list(env))
    else:
        document = traced("torchrun", tmp_path, sets, env=env)
    assert document["otherData"]["backend"] == backend
    assert_every_rank_recorded_training(document, tmp_path, ("data", "micro-step", "optimizer step"))
    for named in events(document).values():
        assert len(named["bucket"]) > STEPS  # more than one bucket per step
        micro = sorted((e["ts"], e["ts"] + e["dur"]) for e in named["micro-step"])
        for bucket in named["bucket"]:  # reduced after the compiled step, inside the micro-step span
            assert any(start - 1 <= bucket["ts"] <= end + 1 for start, end in micro), bucket


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["fsdp", "zero2", "zero3"])
def test_sharded_backends_timeline_records_the_librarys_collectives(torchrun_traces: dict[str, tuple[dict, Path]],
                                                                    backend: str) -> None:
    """FSDP and DeepSpeed issue their collectives themselves: every one is on the timeline, and the
    reductions each backward pass issues (its gradient buckets) carry the model's gradients."""
    if backend not in torchrun_traces:
        pytest.skip("DeepSpeed is not installed")
    document, out = torchrun_traces[backend]
    expected = STEPS * parameter_bytes(out)
    for rank, named in events(document).items():
        assert len(named["backward"]) == STEPS
        buckets = named["bucket"]
        assert all(e["args"]["op"] in ("allreduce", "reduce_scatter") and e["tid"] == 1 for e in buckets)
        sent = sum(e["args"]["bytes"] for e in buckets)
        # every gradient, once per step (sharded backends pad flat buffers to a multiple of the world size)
        assert expected <= sent <= expected * 1.01, (rank, backend, sent, expected)
        backward = sorted((e["ts"], e["ts"] + e["dur"]) for e in named["backward"])
        for bucket in buckets:  # issued inside a backward pass
            assert any(start - 1 <= bucket["ts"] <= end + 1 for start, end in backward), (rank, bucket)
        if backend != "zero2":  # parameters gathered for the forward passes (ZeRO-3, FSDP full_shard)
            assert sum(e["args"]["bytes"] for e in named["all_gather"]) >= expected, (rank, backend)


SCRIPT = """
import torch
import polytrain.horovod.torch as hvd
hvd.init()
for i in range(3):
    hvd.allreduce(torch.ones(1000) * hvd.rank(), name=f"grads.{i}")
hvd.broadcast_object({"epoch": 1}, root_rank=0)
hvd.shutdown()
"""


def test_horovod_timeline_variable_for_shim_scripts(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    trace = tmp_path / "horovod_timeline.json"
    launch("torchrun", 2, script, env={"HOROVOD_TIMELINE": str(trace)})
    document = json.loads(trace.read_text())
    for named in events(document).values():
        for i in range(3):
            (op,) = named[f"grads.{i}"]
            assert op["args"] == {"op": "allreduce", "bytes": 4000, "process_set": 0}
    assert sorted(events(document)) == [0, 1]
