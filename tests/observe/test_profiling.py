"""The spec's ``profile`` table and ``--profile`` (issue 31): the framework's own profiler over the chosen steps.

torch: ``<output>/profile/rank0.pt.trace.json`` is the Chrome trace ``torch.profiler`` exports (Perfetto and
TensorBoard's PyTorch plugin open it); it holds a ``ProfilerStep#N`` range for each profiled step and no other, and
inside each the forward's operators, the backward's autograd functions and the optimizer's step; with ``--timeline``
polytrain's own spans of those steps are merged into it. TensorFlow: the
XSpace that ``tf.profiler.experimental`` writes under ``plugins/profile/`` (where TensorBoard's profile plugin
reads it), parsed with TensorFlow's own ``xplane_pb2``: one ``train`` step marker per profiled step, and the step's
ops. The collectives of a 2-rank job are checked in tests/multiproc/test_profile_ddp.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polytrain import cli

SPEC: dict[str, Any] = {
    "backend": "local",
    "model": {"name": "mlp", "params": {"hidden_sizes": [4]}},
    "data": {"name": "synthetic", "batch_size": 12, "val_fraction": 0.2,
             "synthetic": {"samples": 100, "features": 6, "classes": 3, "noise": 1.5}},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "loop": {"epochs": 1}, "seed": 3,
}


def train(tmp_path: Path, framework: str, *args: str) -> Path:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**SPEC, "framework": framework, "output": str(tmp_path / "out")}))
    assert cli.main(["train", str(spec), "--quiet", *args]) == 0
    return tmp_path / "out"


def steps_and_contents(trace: dict[str, Any]) -> dict[int, set[str]]:
    """Profiled step → the names of the events on the step's thread within its ``ProfilerStep#N`` range."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    out = {}
    for marker in (e for e in events if e["name"].startswith("ProfilerStep#")):
        start, end = marker["ts"], marker["ts"] + marker["dur"]
        out[int(marker["name"].split("#")[1])] = {
            e["name"] for e in events if e["tid"] == marker["tid"] and start <= e["ts"] and e["ts"] + e["dur"] <= end}
    return out


def test_torch_profiler_traces_exactly_the_chosen_steps(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = train(tmp_path, "torch", "--set", "profile.steps=[2,3]", "--set", "profile.memory=true",
                "--timeline", str(tmp_path / "timeline.json"))
    (trace_file,) = (out / "profile").iterdir()
    assert trace_file.name == "rank0.pt.trace.json"
    trace = json.loads(trace_file.read_text())
    steps = steps_and_contents(trace)
    assert sorted(steps) == [2, 3]
    for names in steps.values():
        assert {"aten::linear", "Optimizer.step#SGD.step"} <= names, names  # forward and optimizer
        assert any(n.startswith("autograd::engine::evaluate_function: AddmmBackward") for n in names)  # backward
    assert trace["profile_memory"] == 1
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])
    # --timeline: polytrain's own spans of the profiled steps, merged on the profiler's clock
    merged = [e for e in trace["traceEvents"] if e.get("pid") == "polytrain timeline (rank 0)" and e["ph"] == "X"]
    assert sorted({e["args"]["step"] for e in merged if e["name"] == "optimizer step"}) == [2, 3]
    markers = {e["name"]: e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    for e in merged:
        if e["name"] == "optimizer step":  # inside its step's marker, give or take the two clocks' reading
            marker = markers[f"ProfilerStep#{e['args']['step']}"]
            assert marker["ts"] - 1000 <= e["ts"] and e["ts"] + e["dur"] <= marker["ts"] + marker["dur"] + 1000


def test_profile_flag_sets_the_steps(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = train(tmp_path, "torch", "--profile", "4:6")
    assert sorted(steps_and_contents(json.loads((out / "profile" / "rank0.pt.trace.json").read_text()))) == [4, 5, 6]


def test_without_a_profile_table_nothing_is_profiled(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    assert not (train(tmp_path, "torch") / "profile").exists()


def test_tensorflow_profiler_marks_each_chosen_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    out = train(tmp_path, "tensorflow", "--set", "profile.steps=[2,3]")
    (space_file,) = (out / "profile" / "rank0" / "plugins" / "profile").glob("*/*.xplane.pb")
    space = xplane_pb2.XSpace()
    space.ParseFromString(space_file.read_bytes())
    (host,) = [plane for plane in space.planes if plane.name == "/host:CPU"]
    names = {k: v.name for k, v in host.event_metadata.items()}
    stat_names = {k: v.name for k, v in host.stat_metadata.items()}
    markers = [{stat_names[s.metadata_id]: s.int64_value for s in e.stats}
               for line in host.lines for e in line.events if names[e.metadata_id] == "train"]
    assert sorted(m["step_num"] for m in markers) == [2, 3]
    ops = {names[e.metadata_id].split(":")[-1] for line in host.lines for e in line.events}
    assert "MatMul" in ops or "_MklMatMul" in ops or "_FusedMatMul" in ops, sorted(ops)[:50]
