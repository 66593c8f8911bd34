"""A profiled and tracked 2-rank job (issue 31): DDP or FSDP under torchrun, MPI under mpirun. Each profiled rank
writes its own torch.profiler trace, whose profiled steps hold the backend's gradient collective (DDP's
all-reduce, FSDP's reduce-scatter, over gloo; MPI's through the merged timeline) beside the forward, backward and
optimizer operators; and only rank 0 logs to the tracker (one MLflow run, whose losses are metrics.jsonl's).
DeepSpeed ZeRO-2, Horovod and the tensor- and pipeline-parallel layouts: the same, with their own collectives; TensorFlow's
profiler on 2 tf-multiworker ranks, with the strategy's CollectiveReduceV2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from procs import check, command, job_env, read_metrics, run, train
from specs import as_sets, lm

from polytrain.horovod.common import _import_error

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]
WORKER = str(Path(__file__).resolve().parent / "traced_worker.py")
PROFILED = ["loop.max_steps=4", "profile.steps=[2,3]", "profile.ranks=[0,1]"]


#: each backend's gradient collective in the trace: as torch.profiler names the c10d op; the MPI backend's
#: (mpi4py, which torch.profiler does not see) as polytrain's named range around it, and as its timeline span,
#: merged in under --timeline
COLLECTIVE = {"ddp": {"c10d::allreduce_"}, "fsdp": {"c10d::_reduce_scatter_base_"},
              "mpi": {"polytrain::mpi gradient sync", "gradient bucket 0"}}


def profiled_steps(out: Path, rank: int) -> list[set[str]]:
    """The names of the events inside each of rank ``rank``'s profiled steps (2 and 3, checked), from its trace."""
    events = [e for e in json.loads((out / "profile" / f"rank{rank}.pt.trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X"]
    markers = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    assert [m["name"] for m in markers] == ["ProfilerStep#2", "ProfilerStep#3"]
    return [{e["name"] for e in events if m["ts"] <= e["ts"] <= m["ts"] + m["dur"]} for m in markers]


def tracked(backend: str, database: Path) -> list[str]:
    return [f"backend={backend}", *PROFILED, "loop.log_every_n_steps=1", f"logging.mlflow.tracking_uri=sqlite:///{database}"]


def assert_profiled_and_tracked(out: Path, database: Path, backend: str) -> None:
    for rank in (0, 1):
        for inside in profiled_steps(out, rank):
            assert {*COLLECTIVE[backend], "aten::linear", "Optimizer.step#SGD.step"} <= inside, (rank, sorted(
                n for n in inside if n.startswith("c10d")))
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{database}")
    (run,) = client.search_runs([client.get_experiment_by_name("polytrain").experiment_id])
    assert run.data.tags["polytrain.world_size"] == "2" and run.data.tags["polytrain.backend"] == backend
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert logged == {r["step"]: r["loss"] for r in read_metrics(out, "step")} and sorted(logged) == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def torchrun_profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun launch of ``traced_worker.py`` (torch's import and the agent once) that runs, in turn, DDP and
    FSDP tracked to MLflow (where MLflow imports) and the torchrun layouts of `LAYOUTS` (DeepSpeed where it
    imports), each profiled into ``root/NAME`` (MLflow's database ``root/NAME.db``)."""
    root = tmp_path_factory.mktemp("torchrun")
    found = {m: importlib.util.find_spec(m) is not None for m in ("mlflow", "deepspeed")}
    runs = [*([[*tracked(b, root / f"{b}.db"), f"output={root / b}"] for b in ("ddp", "fsdp")] if found["mlflow"]
              else []),
            *[[*LAYOUTS[n][0], *PROFILED, f"output={root / n}"] for n in TORCHRUN_LAYOUTS
              if n != "deepspeed" or found["deepspeed"]]]
    check(run(command("torchrun", [WORKER, json.dumps({"runs": [{"sets": r} for r in runs]})], 2), env=job_env(),
              timeout=560))
    return root


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", sorted(COLLECTIVE))
def test_every_profiled_rank_traces_its_collectives_and_rank_0_alone_tracks(tmp_path: Path, backend: str,
                                                                           request: pytest.FixtureRequest) -> None:
    pytest.importorskip("mlflow")
    if backend != "mpi":  # DDP and FSDP: runs of the shared torchrun launch
        root = request.getfixturevalue("torchrun_profiles")
        assert_profiled_and_tracked(root / backend, root / f"{backend}.db", backend)
        return
    out, database = tmp_path / "out", tmp_path / "mlflow.db"
    check(train(out, tracked(backend, database), nproc=2, launcher="mpirun", args=["--timeline", str(tmp_path / "t.json")]))
    assert_profiled_and_tracked(out, database, backend)


#: the layouts issue 31 names beyond the data-parallel backends: DeepSpeed ZeRO-2 (its gradient reduction and the
#: all-gather of the updated partitions, over gloo), tensor parallel (DTensor's all-reduce of a row-parallel output,
#: the gathered logits) and pipeline parallel (the stages' send/recv)
LAYOUTS = {
    "deepspeed": (["backend=deepspeed", "deepspeed.stage=2"], {"c10d::allreduce_", "c10d::_allgather_base_"}),
    "tensor2": (["backend=ddp", "parallel.tensor=2", *as_sets(lm(n_layers=2, tie_weights=False))],
                {"c10d::allreduce_", "c10d::allgather_into_tensor_coalesced_"}),
    "pipeline2": (["backend=ddp", "parallel.pipeline=2", *as_sets(lm(n_layers=2, tie_weights=False))],
                  {"c10d::send", "c10d::recv_"}),
    # real Horovod's ops are not c10d ops: polytrain's named range around them, under horovodrun (gloo)
    "horovod": (["backend=horovod"], {"polytrain::horovod gradient sync"}),
}


TORCHRUN_LAYOUTS = ("tensor2", "pipeline2", "deepspeed")  # in the shared torchrun launch; horovod under horovodrun


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_deepspeed_and_the_parallel_layouts_are_profiled_with_their_collectives(tmp_path: Path, layout: str,
                                                                               request: pytest.FixtureRequest) -> None:
    sets, collectives = LAYOUTS[layout]
    if layout in ("deepspeed", "horovod"):
        pytest.importorskip("deepspeed" if layout == "deepspeed" else "horovod.torch")
    if layout in TORCHRUN_LAYOUTS:
        out = request.getfixturevalue("torchrun_profiles") / layout
    else:
        out = tmp_path / "out"
        check(train(out, [*sets, *PROFILED], nproc=2, launcher="horovodrun-gloo"))
    for rank in (0, 1):
        for inside in profiled_steps(out, rank):
            assert {*collectives, "aten::linear"} <= inside, (rank, sorted(n for n in inside if n.startswith("c10d")))
            assert any(name.startswith("Optimizer.step#") for name in inside), rank


#: each TensorFlow backend's gradient collective in its XSpace: polytrain's named event (horovod: real Horovod's
#: TensorFlow ops under mpirun). tf-multiworker (the strategy's CollectiveReduceV2) is refused with a profile table:
#: TensorFlow's profiler crashed a rank as it stopped, 1 run in 5 (tests/test_registry.py checks the refusal).
TF_COLLECTIVE = {"mpi": "polytrain::mpi gradient sync", "horovod": "polytrain::horovod gradient sync"}


@pytest.mark.parametrize("backend", sorted(TF_COLLECTIVE))
def test_tensorflow_ranks_are_profiled_with_their_collectives(tmp_path: Path, backend: str) -> None:
    """TensorFlow's profiler on the backends other than local: 2 ranks under mpirun, each profiled rank's XSpace
    holding the chosen steps and the backend's gradient all-reduce."""
    pytest.importorskip("tensorflow")
    if backend == "horovod" and _import_error("horovod.tensorflow") is not None:
        pytest.skip("Horovod with TensorFlow ops is not installed (scripts/build_horovod.sh)")
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    out = tmp_path / "out"
    check(train(out, ["framework=tensorflow", f"backend={backend}", "loop.max_steps=4", "profile.steps=[2,3]",
                      "profile.ranks=[0,1]"], nproc=2, launcher="mpirun", timeout=400))
    for rank in (0, 1):
        (space_file,) = (out / "profile" / f"rank{rank}" / "plugins" / "profile").glob("*/*.xplane.pb")
        space = xplane_pb2.XSpace()
        space.ParseFromString(space_file.read_bytes())
        (host,) = [plane for plane in space.planes if plane.name == "/host:CPU"]
        names = {k: v.name for k, v in host.event_metadata.items()}
        stat_names = {k: v.name for k, v in host.stat_metadata.items()}
        steps = sorted({s.int64_value for line in host.lines for e in line.events if names[e.metadata_id] == "train"
                        for s in e.stats if stat_names[s.metadata_id] == "step_num"})
        assert steps == [2, 3], rank
        ops = {names[e.metadata_id] for line in host.lines for e in line.events}
        assert any(TF_COLLECTIVE[backend] in op for op in ops), (rank, sorted(ops)[:80])
