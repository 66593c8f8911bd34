"""The ``polytrain`` command: ``train``, ``launch``, ``compare``, ``plan``, ``info``.

Bad input ends with one line on stderr naming the field or flag, and exit code 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from polytrain.errors import Preempted, TrainingFailure, UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _check_writable(flag: str, path: str) -> None:
    """Fail before the work, not after it, when ``path`` cannot be written: its directory is created and a
    probe file written there (`polytrain.checkpoint.files.make_writable_dir`)."""
    from polytrain.checkpoint.files import make_writable_dir

    parent = Path(path).absolute().parent
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: cannot write it ({existing} is not a directory); give a path in a "
                        f"writable directory")
    try:
        make_writable_dir(parent)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write it (cannot create files in {parent}: "
                        f"{exc.strerror or exc}); give a path in a writable directory") from None


def _profile_sets(value: str | None) -> list[str]:
    """``--profile FIRST:LAST`` as the spec's ``profile.steps`` (the table's other fields keep their values)."""
    if value is None:
        return []
    first, colon, last = value.partition(":")
    if not (colon and first.strip().isdigit() and last.strip().isdigit()):
        raise UserError(f"--profile {value}: expected FIRST:LAST, two optimizer step numbers (e.g. --profile 5:8)")
    return [f"profile.steps=[{int(first)},{int(last)}]"]


def _cmd_train(args: argparse.Namespace) -> int:
    from polytrain import validation

    spec = validation.load(args.spec, [*(args.set or ()), *_profile_sets(args.profile)])
    if args.timeline:
        _check_writable("--timeline", args.timeline)
    if not args.debug:
        # torch's C++ side logs its own errors (with C++ stack frames) before raising them; polytrain
        # reports each failure in one line, so only fatal C++ messages stay (set the variable to see all).
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    if spec.framework == "tensorflow":  # each rank's copy of TensorFlow's start-up notices, unless asked for
        from polytrain.adapters.tensorflow.start import import_tensorflow_quietly

        import_tensorflow_quietly()
    from polytrain.train.trainer import Trainer

    global _started, _trained
    _started = True
    Trainer(spec, show_progress=not args.quiet, resume=args.resume, timeline=args.timeline,
            verbose=args.verbose, accept_changed_data=args.accept_changed_data,
            overwrite_checkpoints=args.overwrite_checkpoints).fit()
    _trained = True
    return 0


_started = False  # a training run began here: collectives may have run (and left threads behind)
_trained = False  # a training run finished here: its outputs are written and its process group is gone


def run() -> NoReturn:
    """The process entry point (console script and ``python -m polytrain.cli``)."""
    code = main()
    if _started:
        exit_after_training(code)
    sys.exit(code)


def exit_after_training(code: int = 0) -> NoReturn:
    """End a process whose training run began, with ``code``, without the interpreter's final teardown.

    A gloo worker thread may still be releasing the last collective's tensors; once the interpreter is
    finalizing, that thread cannot take the GIL to do so and aborts the process (SIGABRT, "terminate
    called without an active exception"), turning a finished run into a failed rank, or a rank's one-line
    failure into a crash. Everything the run wrote is flushed and closed by then; the exit handlers
    (Horovod's shutdown, TensorBoard, ...) and MPI's finalize still run here, while the interpreter is alive.
    """
    import atexit

    atexit._run_exitfuncs()
    mpi_module = sys.modules.get("mpi4py.MPI")
    if mpi_module is not None and mpi_module.Is_initialized() and not mpi_module.Is_finalized():
        mpi_module.Finalize()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    os._exit(code)


def _cmd_launch(args: argparse.Namespace) -> int:
    from polytrain import launchers

    return launchers.launch_from_args(args)


def _cmd_info(args: argparse.Namespace) -> int:
    from polytrain.commands import info as info

    report = info.collect()
    print(info.to_json(report) if args.json else info.to_table(report))
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from polytrain.commands import checkpoint as tools

    if args.action == "inspect":
        print(tools.describe_json(Path(args.path)) if args.json else tools.inspect(Path(args.path)))
    elif args.action == "convert":
        suffix = {"safetensors": ".safetensors", "torch": ".pt", "keras": ".weights.h5"}.get(args.to, "")
        out = Path(args.output) if args.output else Path(f"model{suffix}")
        spec = Path(args.spec) if args.spec else None
        print(f"wrote {tools.convert(Path(args.path), args.to, out, spec, args.set or [], args.trust_checkpoint)}")
    else:
        spec = Path(args.spec) if args.spec else None
        out = tools.import_weights(Path(args.path), spec, args.set or [], Path(args.output), args.trust_checkpoint,
                                   tag=args.tag)
        print(f"wrote {out} (resume from it with: polytrain train SPEC --resume {out})")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from polytrain.commands.compare import compare_from_args

    return compare_from_args(args)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from polytrain.commands.sweep import sweep_from_args

    return sweep_from_args(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from polytrain.plan.command import plan_from_args

    return plan_from_args(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from polytrain.commands.doctor import doctor_from_args

    return doctor_from_args(args)


def _cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from polytrain.commands.plot import plot

    _check_writable("-o", args.output)
    print(f"wrote {plot([Path(p) for p in args.runs], Path(args.output))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="polytrain", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train from a spec, as one rank of whatever launched this process")
    train.add_argument("spec", nargs="?", default=None, help="YAML/TOML/JSON spec file (default: built-in defaults)")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec field, e.g. loop.epochs=3")
    train.add_argument("--quiet", action="store_true", help="no progress output")
    train.add_argument("--verbose", action="store_true", help="every rank shows its progress, not only rank 0")
    train.add_argument("--resume", nargs="?", const="auto", metavar="auto|PATH",
                       help="continue from a checkpoint: 'auto' (the default when given without a value) = the "
                            "newest complete one in checkpoint.dir; or a checkpoint directory")
    train.add_argument("--accept-changed-data", action="store_true",
                       help="with --resume: go on although the data changed since the checkpoint (different sample "
                            "counts, files, sizes or times); its epoch starts over on the data as it is now")
    train.add_argument("--overwrite-checkpoints", action="store_true",
                       help="a new run into a checkpoint.dir that holds another run's checkpoints: move them into "
                            "<checkpoint.dir>/superseded-<time>-<pid>/ (nothing is deleted) instead of refusing")
    train.add_argument("--timeline", metavar="FILE",
                       help="write a Chrome-trace timeline of every rank (compute, collectives, optimizer, data, "
                            "checkpoints) to FILE; open it in https://ui.perfetto.dev")
    train.add_argument("--profile", metavar="FIRST:LAST",
                       help="run the framework's profiler (torch.profiler, tf.profiler) over optimizer steps FIRST to "
                            "LAST, as the spec's profile table; traces under <output>/profile")
    train.set_defaults(func=_cmd_train)

    launch = sub.add_parser("launch", help="build and run the launcher command line for N processes")
    try:
        from polytrain.launchers import add_launch_arguments
    except ImportError:  # launchers not installed: keep train/info working
        add_launch_arguments = None
    if add_launch_arguments is not None:
        add_launch_arguments(launch)
    launch.set_defaults(func=_cmd_launch)

    checkpoint = sub.add_parser("checkpoint", help="inspect, convert or import checkpoints")
    actions = checkpoint.add_subparsers(dest="action", required=True, parser_class=_Parser)
    inspect_p = actions.add_parser("inspect", help="what a checkpoint or model directory holds")
    inspect_p.add_argument("path")
    inspect_p.add_argument("--json", action="store_true")
    convert_p = actions.add_parser("convert", help="plain single-file model weights")
    convert_p.add_argument("path")
    convert_p.add_argument("--to", required=True, choices=("safetensors", "torch", "keras"))
    convert_p.add_argument("-o", "--output", help="output file (default: model.<ext> here)")
    convert_p.add_argument("--spec", help="--to keras: build the model from this spec (default: the checkpoint's own, "
                                          "without importing code it names)")
    convert_p.add_argument("--set", action="append", metavar="KEY=VALUE", help="--to keras: override a --spec field")
    convert_p.add_argument("--trust-checkpoint", action="store_true",
                           help="--to keras: import the model code the checkpoint's manifest names (only for "
                                "checkpoints from a trusted source)")
    import_p = actions.add_parser("import", help="a DeepSpeed ZeRO checkpoint dir or a torch state_dict file")
    import_p.add_argument("path")
    import_p.add_argument("--spec", help="the spec the weights belong to (default: built-in defaults)")
    import_p.add_argument("--set", action="append", metavar="KEY=VALUE")
    import_p.add_argument("-o", "--output", required=True, help="checkpoint root to write step-00000000 into")
    import_p.add_argument("--tag", help="the DeepSpeed checkpoint tag to import (default: the one in its 'latest')")
    import_p.add_argument("--trust-checkpoint", action="store_true",
                          help="allow unpickling (only for files from a trusted source)")
    checkpoint.set_defaults(func=_cmd_checkpoint)

    plot = sub.add_parser("plot", help="loss, validation accuracy and throughput of one or more runs")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output directories of runs")
    plot.add_argument("-o", "--output", default="polytrain-runs.png", help="image file (default: %(default)s)")
    plot.set_defaults(func=_cmd_plot)

    info = sub.add_parser("info", help="versions, launchers and which backends are usable here")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_cmd_info)

    compare = sub.add_parser("compare", help="the same spec or loop script on several backends: one table of the "
                                             "loss and weight differences and step times")
    from polytrain.commands.compare import add_compare_arguments

    add_compare_arguments(compare)
    compare.set_defaults(func=_cmd_compare)

    plan_p = sub.add_parser("plan", help="which layouts fit N ranks: per-rank memory and bytes sent per step, "
                                         "predicted, and the one to run")
    from polytrain.plan.command import add_plan_arguments

    add_plan_arguments(plan_p)
    plan_p.set_defaults(func=_cmd_plan)

    doctor = sub.add_parser("doctor", help="pre-flight check on the job's ranks: the slow rank, link or host, "
                            "mismatched versions, clocks and disks, named before training")
    from polytrain.commands.doctor import add_doctor_arguments

    add_doctor_arguments(doctor)
    doctor.set_defaults(func=_cmd_doctor)
    sweep_p = sub.add_parser("sweep", help="a grid of runs of one spec as Ray Tune trials: a table of the trials, "
                                           "the best by a metric marked, and a CSV")
    from polytrain.commands.sweep import add_sweep_arguments

    add_sweep_arguments(sweep_p)
    sweep_p.set_defaults(func=_cmd_sweep)
    for choices in (sub, actions):  # a missing command then lists the allowed ones, not argparse's dest name
        choices.metavar = "{" + ",".join(choices.choices) + "}"
    return parser


def _unrecognized(args: argparse.Namespace, extras: list[str]) -> NoReturn:
    """argparse's "unrecognized arguments", from the subcommand that got them; a flag that is the name of a
    spec field (``--epochs``) gets the ``--set`` that sets it."""
    prog = " ".join(part for part in ("polytrain", args.command, getattr(args, "action", None)) if part)
    hint = ""
    if hasattr(args, "set"):
        from polytrain.spec.tables import field_paths

        for i, arg in enumerate(extras):
            name, _, value = arg.lstrip("-").partition("=")
            name = name.replace("-", "_")
            matches = sorted((path for path in field_paths() if path == name or path.endswith(f".{name}")),
                             key=lambda path: path.count("."))
            if arg.startswith("--") and matches:
                value = value or (extras[i + 1] if i + 1 < len(extras) and not extras[i + 1].startswith("-")
                                  else "VALUE")
                hint = f"; spec fields are set with --set, e.g. --set {matches[0]}={value}"
                break
    _Parser(prog=prog).exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extras)}{hint} "
                               f"(see {prog} --help)\n")


def abort_mpi_job(code: int, show_traceback: bool = False) -> None:
    """End the whole MPI job when this process started MPI and fails: its peers may be waiting in a
    collective it will never join, and MPI_Finalize at exit would wait for them (until the timeout).

    Does nothing when MPI was never initialised here (mpi4py not imported) or the job has one process.
    """
    mpi_module = sys.modules.get("mpi4py.MPI")
    if mpi_module is None:
        return
    MPI: Any = mpi_module
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    if show_traceback:
        import traceback

        traceback.print_exc()
    sys.stderr.flush()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(code)


def failure_text(exc: UserError | TrainingFailure) -> str:
    """What a failed command prints: one line; an exception in the user's code (`polytrain.spec.user_code.call_user`)
    gets the user's frames above it and, in a job of several processes, the rank it happened on."""
    from polytrain.spec.user_code import UserCodeError

    if not isinstance(exc, UserCodeError):
        return f"polytrain: error: {exc}"
    try:
        from polytrain.environments import detect_world

        world = detect_world()
        rank = f"rank {world.rank}: " if world.size > 1 else ""
    except Exception:  # noqa: BLE001 - an unreadable environment only leaves the rank out
        rank = ""
    return exc.report(f"polytrain: {rank}")


def _exit_board(code: int | None = None, exc: BaseException | None = None) -> None:
    """Under `polytrain launch` (it passes POLYTRAIN_EXIT_BOARD): record that this rank started (``code``
    None) or how it ended, so that launch can name the rank that failed (polytrain.launchers.exit_board)."""
    if not os.environ.get("POLYTRAIN_EXIT_BOARD"):
        return
    try:
        from polytrain.launchers import exit_board
    except ImportError:  # launchers not installed
        return
    if code is None:
        exit_board.record_start()
    else:
        exit_board.record_end(code, exc)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(args, extras)
    _exit_board()
    try:
        code = int(args.func(args) or 0)
        _exit_board(code)
        return code
    except (UserError, TrainingFailure) as exc:
        _exit_board(exc.exit_code, exc)
        if args.debug:
            raise
        # one write of the whole line: print writes the text and its newline apart, and the other ranks' lines
        # (one pipe under a launcher) came in between: "...instead)polytrain: error: ..." on one line
        sys.stderr.write(failure_text(exc) + "\n")
        sys.stderr.flush()
        abort_mpi_job(exc.exit_code)
        return exc.exit_code
    except Preempted as exc:  # every rank stopped at the same step, its checkpoint settled: no MPI abort
        _exit_board(exc.exit_code, exc)
        if exc.show:
            sys.stderr.write(f"polytrain: {exc}\n")
            sys.stderr.flush()
        return exc.exit_code
    except BrokenPipeError:  # e.g. `polytrain checkpoint inspect X | head`: before Exception, its base class
        _exit_board(0)
        return 0
    except Exception as exc:
        _exit_board(1, exc)
        abort_mpi_job(1, show_traceback=True)
        raise
    except KeyboardInterrupt as exc:
        _exit_board(130, exc)
        print("polytrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    run()
