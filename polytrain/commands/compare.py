"""``polytrain compare``: the same job on several backends, and one table of how far each is from the first.

``polytrain compare SPEC -np 2 --backends horovod,ddp,fsdp,deepspeed --steps 20`` starts, one after the
other, ``polytrain launch --launcher L -np 2 SPEC --set backend=B --set loop.max_steps=20
--set loop.log_every_n_steps=1 --set output=OUT/B`` for each backend B (L: mpirun for mpi, horovod,
tf-multiworker and every TensorFlow spec, torchrun otherwise), then reads what each run wrote
(`polytrain.commands.compare_runs`) and prints, per backend, the largest absolute and relative differences of the step
losses and of the final weights against the first backend, and its mean step time. Exit code 0 when every
relative difference is within ``--tolerance``, 1 when one is not or a run failed, 2 on bad input.

``polytrain compare --script loop.py -np 2 --backends ddp,fsdp --steps 20 [-- SCRIPT ARGS]`` runs a
hand-written loop instead. The script's side of the contract: it takes its backend from
`polytrain.compare.backend` and its number of steps from `polytrain.compare.steps` (the variables
``POLYTRAIN_COMPARE_BACKEND`` and ``POLYTRAIN_COMPARE_STEPS``) and writes what is compared through
`polytrain.compare.Record` (into ``POLYTRAIN_COMPARE_OUT``); outside ``polytrain compare`` those give their
defaults and `Record` writes nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from polytrain.commands.compare_runs import ENV_BACKEND, ENV_OUT, ENV_STEPS, Record, backend, steps
from polytrain.errors import UserError
from polytrain.observe.redact import redact_text

__all__ = ["Record", "add_compare_arguments", "backend", "compare_from_args", "launcher_for", "steps"]

DEFAULT_STEPS = 20
#: relative to the reference's largest value (`polytrain.commands.compare_runs`): fp32 backends that average gradients
#: exactly agree far closer than this; a real change (another learning rate, a lost gradient) is far above it
DEFAULT_TOLERANCE = 1e-5
#: the backends started by mpirun (the others by torchrun); every TensorFlow spec runs under mpirun
MPI_BACKENDS = ("mpi", "horovod", "tf-multiworker")


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``polytrain compare`` flags."""
    parser.add_argument("target", nargs="*", metavar="SPEC | -- SCRIPT ARGS",
                        help="the spec to run on each backend; with --script, the script's arguments")
    parser.add_argument("--script", metavar="FILE.py", help="compare a hand-written loop instead of a spec")
    parser.add_argument("-np", "--num-proc", dest="nproc", metavar="N", default="2",
                        help="processes per run (default: %(default)s)")
    parser.add_argument("--backends", metavar="B1,B2,...", help="backends to run; the first is the reference")
    parser.add_argument("--steps", metavar="N", default=str(DEFAULT_STEPS),
                        help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--tolerance", metavar="X", default=str(DEFAULT_TOLERANCE),
                        help="largest relative difference that passes (default: %(default)s)")
    parser.add_argument("--out", metavar="DIR", help="where the runs and their logs go (default: a temporary "
                                                     "directory, removed when everything matches)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field in every run")
    parser.add_argument("--set-for", action="append", default=[], metavar="BACKEND:KEY=VALUE",
                        help="override a spec field in one backend's run (e.g. deepspeed:deepspeed.stage=3)")


@dataclass(frozen=True)
class Plan:
    """What a comparison runs: ``target`` a spec or (``script``) a loop script with ``script_args``."""

    target: str
    script: bool
    script_args: tuple[str, ...]
    backends: tuple[str, ...]
    launchers: tuple[str, ...]
    nproc: int
    steps: int
    tolerance: float
    sets: tuple[str, ...]
    set_for: dict[str, tuple[str, ...]]


def launcher_for(framework: str, name: str) -> str:
    """The launcher a backend's run is started with (as scripts/tour.sh does)."""
    return "mpirun" if framework == "tensorflow" or name in MPI_BACKENDS else "torchrun"


def _count(flag: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UserError(f"{flag} must be an integer >= 1, got {value!r}")
    return number


def _tolerance(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not math.isfinite(number) or number < 0:
        raise UserError(f"--tolerance must be a number >= 0, got {value!r}")
    return number


def _framework(spec: str, sets: Sequence[str]) -> str:
    """The spec's framework, after checking the spec with the overrides of every run (its imports not made)."""
    from polytrain import validation
    from polytrain.spec.files import apply_overrides, load_raw
    from polytrain.spec.user_code import imports_skipped

    with imports_skipped():
        return validation.from_dict(apply_overrides(load_raw(spec), list(sets))).framework


def _check_backend(name: str, framework: str | None, nproc: int) -> None:
    """A backend of ``framework`` (any framework's, for a script) that can run here on ``nproc`` processes."""
    from polytrain import registry

    rows = [row for row in registry.BACKENDS if row.name == name]
    if not rows:
        raise UserError(f"--backends: {name!r} is not a backend; choose from {', '.join(registry.all_backend_names())}")
    if framework is not None:
        rows = [row for row in rows if row.framework == framework]
        if not rows:
            raise UserError(f"--backends: {name!r} is not a backend of framework {framework!r}; it has "
                            f"{', '.join(registry.backends_for(framework))}")
    reasons = [row.unusable_reason() for row in rows]
    if all(reasons):
        raise UserError(f"--backends: {name} cannot run here: {reasons[0]}")
    row = rows[reasons.index(None)]
    if row.max_world is not None and nproc > row.max_world:
        raise UserError(f"--backends: {name} runs at most {row.max_world} process(es); -np is {nproc}")
    if nproc < row.min_world:
        raise UserError(f"--backends: {name} needs at least {row.min_world} processes; -np is {nproc}")


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The comparison the flags describe; every mistake is a one-line `UserError` naming the flag."""
    from polytrain.launchers import registry as launchers

    nproc, step_count = _count("-np", args.nproc), _count("--steps", args.steps)
    tolerance = _tolerance(args.tolerance)
    if args.script is not None:
        if not args.script.endswith(".py") or not Path(args.script).is_file():
            raise UserError(f"--script {args.script}: not a Python file (.py) here")
        if args.set or args.set_for:
            raise UserError("--set/--set-for: only for a spec; a script takes its own arguments after --")
        target, script_args = args.script, tuple(args.target)
    elif len(args.target) != 1:
        raise UserError("polytrain compare needs one spec (.yaml/.yml/.toml/.json) or --script FILE.py"
                        if not args.target else f"one spec only; got {' '.join(args.target)} "
                                                f"(a script's arguments go after --script FILE.py --)")
    else:
        target, script_args = args.target[0], ()
    names = tuple(name.strip() for name in (args.backends or "").split(",") if name.strip())
    if not names:
        raise UserError("--backends: give the backends to compare, e.g. --backends ddp,fsdp (the first is the "
                        "reference)")
    if len(set(names)) != len(names):
        raise UserError(f"--backends: {args.backends} names a backend twice")
    set_for: dict[str, list[str]] = {name: [] for name in names}
    for item in args.set_for:
        name, sep, setting = item.partition(":")
        if not sep or "=" not in setting:
            raise UserError(f"--set-for {item}: expected BACKEND:KEY=VALUE")
        if name not in set_for:
            raise UserError(f"--set-for {item}: {name!r} is not one of --backends {','.join(names)}")
        set_for[name].append(setting)
    framework = None if args.script else _framework(target, args.set)
    for name in names:
        _check_backend(name, framework, nproc)
        if not args.script:
            from polytrain.launchers.args import check_spec

            try:
                check_spec([target, *(a for s in (*args.set, *set_for[name], f"backend={name}") for a in ("--set", s))],
                           world_size=nproc)
            except UserError as exc:
                raise UserError(f"{target} with backend {name}: {exc}") from None
    chosen = tuple(launcher_for(framework or "torch", name) for name in names)
    for name in dict.fromkeys(chosen):
        launchers.launcher(name).require_binary(name)
    return Plan(target, bool(args.script), script_args, names, chosen, nproc, step_count, tolerance,
                tuple(args.set), {k: tuple(v) for k, v in set_for.items()})


def launch_command(plan: Plan, name: str, launcher: str, run_dir: Path) -> list[str]:
    """The ``polytrain launch`` command line of one backend's run."""
    head = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", launcher, "-np", str(plan.nproc)]
    if plan.script:
        return [*head, "-x", ENV_BACKEND, "-x", ENV_STEPS, "-x", ENV_OUT, plan.target, *plan.script_args]
    own = (f"backend={name}", f"loop.max_steps={plan.steps}", "loop.log_every_n_steps=1", f"output={run_dir}",
           f"checkpoint.dir={run_dir / 'checkpoints'}")
    return [*head, plan.target, "--quiet", *(a for s in (*plan.sets, *plan.set_for[name], *own) for a in ("--set", s))]


def _run_one(plan: Plan, name: str, launcher: str, run_dir: Path, log: Path) -> str | None:
    """Launch one backend's run, its output into ``log``; None when it succeeded, else what went wrong."""
    command = launch_command(plan, name, launcher, run_dir)
    env = {**os.environ, ENV_BACKEND: name, ENV_STEPS: str(plan.steps), ENV_OUT: str(run_dir)}
    print(f"compare: {name} under {launcher}, {plan.nproc} processes ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    with log.open("w") as out:
        out.write(redact_text(" ".join(command)) + "\n")  # a --set URI's credential stays out of the log
        out.flush()
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                              stdin=subprocess.DEVNULL).returncode
    took = time.monotonic() - started
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-6:]
        print(f"compare: {name} failed (exit {code}) after {took:.1f}s; the end of {log}:", file=sys.stderr)
        print("\n".join(f"    {line}" for line in tail), file=sys.stderr, flush=True)
        return f"FAILED: exit {code}, see {log}"
    if not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "model.safetensors").is_file():
        what = "polytrain.compare.Record" if plan.script else "the Trainer"
        return f"FAILED: no metrics.jsonl and model.safetensors in {run_dir} (written by {what})"
    print(f"compare: {name} done in {took:.1f}s", file=sys.stderr, flush=True)
    return None


def _check_out(out: Path, backends: Sequence[str]) -> None:
    """Make ``--out`` (a new or empty directory, or one without these backends' runs), or say in one line why it
    cannot be (exit 2): a file there, a run there already, a directory that cannot be made."""
    hint = "give a new or empty directory"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: a file is there, not a directory (compare writes a run directory and a log "
                        f"per backend into it); {hint}")
    for name in backends:
        run = out / name
        if run.exists() and (not run.is_dir() or any(run.iterdir())):
            raise UserError(f"--out {out}: {run} already holds a run; {hint}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot make the directory ({exc.strerror or exc}); {hint} that can be "
                        f"written") from None


def compare_from_args(args: argparse.Namespace) -> int:
    """``polytrain compare``: run every backend, print the table; the exit code (0 match, 1 differ or failed)."""
    from polytrain.commands.compare_runs import Row, difference, format_table, read_run

    plan = plan_from_args(args)
    out = Path(args.out).absolute() if args.out else Path(tempfile.mkdtemp(prefix="polytrain-compare-"))
    _check_out(out, plan.backends)
    rows: list[Row] = []
    for name, launcher in zip(plan.backends, plan.launchers):
        failure = _run_one(plan, name, launcher, out / name, out / f"{name}.log")
        if failure is None:
            try:
                rows.append(Row(name, launcher, read_run(out / name)))
                continue
            except (OSError, ValueError, KeyError, UserError) as exc:
                failure = f"FAILED: cannot read {out / name} ({' '.join(str(exc).split())})"
        rows.append(Row(name, launcher, None, failure=failure))
    reference = rows[0].run
    rows = [rows[0], *(Row(r.backend, r.launcher, r.run, difference(reference, r.run) if reference and r.run else None,
                           r.failure) for r in rows[1:])]
    print(format_table(rows, plan.tolerance), flush=True)
    bad = [r.backend for r in rows if r.failure or (r.diff is not None and not r.diff.within(plan.tolerance))
           or (r.diff is None and r is not rows[0])]
    first = plan.backends[0]
    if bad:
        print(f"compare: {', '.join(bad)} not within {plan.tolerance:g} (relative) of {first}; runs and logs in {out}")
        return 1
    others = ", ".join(plan.backends[1:]) or "nothing else"
    print(f"compare: {others} within {plan.tolerance:g} (relative) of {first} over {plan.steps} steps")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return 0
