"""``polytrain compare``: the same spec (or loop script) on several backends through real launches, one table.

A spec on ddp (torchrun), mpi (mpirun) and fsdp (torchrun), fsdp with another learning rate: mpi matches ddp
exactly, fsdp differs and the exit code is 1; the table's numbers are checked against the runs' own files. A
hand-written loop (tests/multiproc/compare_loop.py, through `polytrain.compare.Record`) on ddp and fsdp matches
and exits 0. Bad input is one line and exit code 2, before anything is launched. The reader's arithmetic
(relative differences, step times that leave out the first step and evaluations) is checked on written files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import job_env, read_metrics, run

from polytrain import cli
from polytrain.checkpoint.store import read_model, write_model
from polytrain.commands.compare_runs import Run, difference, read_run

pytest.importorskip("torch")

SPEC = """\
framework: torch
backend: auto
model: {name: mlp, params: {hidden_sizes: [32]}}
data: {name: digits, batch_size: 16, val_fraction: 0.2}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
loop: {epochs: 1}
"""
LOOP = str(Path(__file__).resolve().parents[1] / "multiproc" / "compare_loop.py")
STEPS = 5
COLUMNS = ("backend", "launcher", "steps", "loss abs", "loss rel", "weights abs", "weights rel", "step ms")


def compare(args: list[str]) -> tuple[int, str, str]:
    done = run([sys.executable, "-m", "polytrain.cli", "compare", *args], env=job_env({"MASTER_ADDR": None}),
               timeout=400)
    assert not done.left_behind, done.left_behind
    return done.returncode, done.stdout, done.stderr


def table(stdout: str) -> dict[str, list[str]]:
    """The table's rows by backend (cells split on runs of two or more spaces)."""
    import re

    lines = stdout.strip().splitlines()
    assert re.split(r"\s{2,}", lines[0].strip()) == [*COLUMNS, "result"], stdout
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:-1])}


@pytest.fixture(scope="module")
def spec_compare(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str, Path]:
    tmp = tmp_path_factory.mktemp("compare")
    (tmp / "tiny.yaml").write_text(SPEC)
    code, out, err = compare([str(tmp / "tiny.yaml"), "-np", "2", "--backends", "ddp,mpi,fsdp", "--steps", str(STEPS),
                              "--set-for", "fsdp:optimizer.lr=0.06", "--out", str(tmp / "runs")])
    return code, out, err, tmp / "runs"


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_spec_on_three_backends(spec_compare: tuple[int, str, str, Path]) -> None:
    code, out, err, runs = spec_compare
    assert code == 1, f"{out}\n{err}"
    rows = table(out)
    assert [r[:3] for r in rows.values()] == [["ddp", "torchrun", "5"], ["mpi", "mpirun", "5"],
                                               ["fsdp", "torchrun", "5"]], out
    assert rows["ddp"][-1] == "reference" and rows["mpi"][-1] == "ok" and rows["fsdp"][-1] == "DIFFERS", out
    assert out.strip().splitlines()[-1].startswith("compare: fsdp not within 1e-05 (relative) of ddp"), out
    # the table against the runs' own files
    losses = {b: np.array([r["loss"] for r in read_metrics(runs / b, "step")]) for b in ("ddp", "mpi", "fsdp")}
    weights = {b: read_model(runs / b)[0] for b in ("ddp", "mpi", "fsdp")}
    assert all(len(v) == STEPS for v in losses.values())
    np.testing.assert_allclose(losses["mpi"], losses["ddp"], rtol=1e-5)
    for name, ref in weights["ddp"].items():
        np.testing.assert_allclose(weights["mpi"][name], ref, rtol=1e-5, atol=1e-7)
    assert float(rows["mpi"][3]) <= 1e-5 * max(abs(losses["ddp"])) and float(rows["mpi"][6]) <= 1e-5
    fsdp_loss = float(np.max(np.abs(losses["fsdp"] - losses["ddp"])))
    fsdp_weights = max(float(np.max(np.abs(weights["fsdp"][n] - w))) for n, w in weights["ddp"].items())
    assert fsdp_loss > 0 and float(rows["fsdp"][3]) == pytest.approx(fsdp_loss, rel=0.01)
    assert float(rows["fsdp"][5]) == pytest.approx(fsdp_weights, rel=0.01) and float(rows["fsdp"][6]) > 1e-5
    assert all(float(rows[b][-2]) > 0 for b in rows)  # a mean step time for each (the reference has no differences)
    assert all((runs / f"{b}.log").is_file() for b in rows)


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_loop_script_on_two_backends(tmp_path: Path) -> None:
    code, out, err = compare(["--script", LOOP, "-np", "2", "--backends", "ddp,fsdp", "--steps", str(STEPS),
                              "--out", str(tmp_path), "--", "--lr", "0.2"])
    assert code == 0, f"{out}\n{err}"
    rows = table(out)
    assert rows["fsdp"][:3] == ["fsdp", "torchrun", "5"] and rows["fsdp"][-1] == "ok", out
    assert out.strip().splitlines()[-1] == "compare: fsdp within 1e-05 (relative) of ddp over 5 steps"
    ddp, fsdp = read_run(tmp_path / "ddp"), read_run(tmp_path / "fsdp")
    assert len(ddp.losses) == STEPS and sorted(ddp.weights) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    np.testing.assert_allclose(fsdp.losses, ddp.losses, rtol=1e-5)
    assert read_model(tmp_path / "fsdp")[1]["backend"] == "fsdp"


BAD = [
    ("unknown-backend", ["{spec}", "--backends", "ddp,foo"], "--backends: 'foo' is not a backend; choose from"),
    ("other-framework", ["{spec}", "--backends", "ddp,tf-multiworker"],
     "--backends: 'tf-multiworker' is not a backend of framework 'torch'"),
    ("local-np", ["{spec}", "--backends", "ddp,local"], "--backends: local runs at most 1 process(es); -np is 2"),
    ("twice", ["{spec}", "--backends", "ddp,ddp"], "--backends: ddp,ddp names a backend twice"),
    ("no-backends", ["{spec}"], "--backends: give the backends to compare"),
    ("np", ["{spec}", "--backends", "ddp", "-np", "0"], "-np must be an integer >= 1, got '0'"),
    ("steps", ["{spec}", "--backends", "ddp", "--steps", "0"], "--steps must be an integer >= 1, got '0'"),
    ("tolerance", ["{spec}", "--backends", "ddp", "--tolerance", "-1"], "--tolerance must be a number >= 0"),
    ("missing-spec", ["{tmp}/missing.yaml", "--backends", "ddp"], "missing.yaml"),
    ("no-spec", ["--backends", "ddp"], "polytrain compare needs one spec"),
    ("missing-script", ["--script", "{tmp}/none.py", "--backends", "ddp"],
     "--script {tmp}/none.py: not a Python file (.py) here"),
    ("set-for-backend", ["{spec}", "--backends", "ddp", "--set-for", "mpi:optimizer.lr=1"],
     "--set-for mpi:optimizer.lr=1: 'mpi' is not"),
    ("set-for-field", ["{spec}", "--backends", "ddp,fsdp", "--set-for", "fsdp:fsdp.sharding=bogus"],
     "with backend fsdp: fsdp.sharding: 'bogus' is not allowed"),
    ("out-holds-run", ["{spec}", "--backends", "ddp", "--out", "{tmp}"], "--out {tmp}: {tmp}/ddp already holds a run"),
    ("out-is-a-file", ["{spec}", "--backends", "ddp", "--out", "{tmp}/tiny.yaml"],
     "--out {tmp}/tiny.yaml: a file is there, not a directory"),
    ("out-under-a-file", ["{spec}", "--backends", "ddp", "--out", "{tmp}/tiny.yaml/runs"],
     "--out {tmp}/tiny.yaml/runs: cannot make the directory (Not a directory)"),
]


@pytest.mark.parametrize(("case", "argv", "expect"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line(case: str, argv: list[str], expect: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tiny.yaml").write_text(SPEC)
    (tmp_path / "ddp").mkdir()
    (tmp_path / "ddp" / "metrics.jsonl").write_text("")
    fill = {"spec": str(tmp_path / "tiny.yaml"), "tmp": str(tmp_path)}
    code = cli.main(["compare", *(a.format(**fill) for a in argv)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith("polytrain: error: ") and expect.format(**fill) in err, err


def _write_run(path: Path, times: list[tuple[int, int, float]], losses: list[float],
               weights: dict[str, np.ndarray]) -> None:
    path.mkdir()
    records = [{"event": "step", "time": t, "step": s, "epoch": e, "loss": loss}
               for (s, e, t), loss in zip(times, losses)]
    records.insert(2, {"event": "epoch", "time": 0.0, "epoch": 0, "step": 2})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_model(path, weights, {"backend": "ddp"})


def test_reader_step_time_and_relative_differences(tmp_path: Path) -> None:
    # steps 1-2 in epoch 0, 3-5 in epoch 1 (an evaluation between them takes 10 s)
    times = [(1, 0, 100.0), (2, 0, 100.5), (3, 1, 111.0), (4, 1, 111.5), (5, 1, 112.0)]
    weights = {"w": np.array([[100.0, 0.001]], dtype=np.float32), "b": np.array([2.0], dtype=np.float32)}
    _write_run(tmp_path / "a", times, [2.0, 1.5, 1.0, 0.5, 0.25], weights)
    got = read_run(tmp_path / "a")
    assert got.step_s == pytest.approx(0.5)  # (0.5 + 1.0) / 3 intervals: the first step and the evaluation left out
    other = Run(got.losses + np.array([0, 0, 0, 0, 0.002]),
                {"w": np.array([[100.0, 0.002]], dtype=np.float32), "b": np.array([2.0], dtype=np.float32)}, None)
    diff = difference(got, other)
    assert diff.loss_abs == pytest.approx(0.002) and diff.loss_rel == pytest.approx(0.001)  # of the largest loss, 2.0
    # 0.001 apart on a weight of 0.001 is relative 1e-5 of that tensor's largest value (100), not 100 %
    assert diff.weight_abs == pytest.approx(0.001, rel=1e-3) and diff.weight_rel == pytest.approx(1e-5, rel=1e-3)
    assert diff.within(2e-3) and not diff.within(5e-4)
    assert difference(got, Run(got.losses[:4], got.weights, None)).problem == "4 step losses, the reference has 5"
    assert "shape" in difference(got, Run(got.losses, {**got.weights, "b": np.zeros(2)}, None)).problem
    assert not difference(got, Run(got.losses, {**got.weights, "b": np.array([np.nan])}, None)).within(1.0)
