"""The ``polytrain launch`` flags, and turning parsed flags into a `LaunchRequest`.

``polytrain launch [--launcher NAME] -np N [-H hosts | --hostfile F] [options]
SPEC|SCRIPT.py [ARGS...] [-- LAUNCHER ARGS...]``. Numbers and names are checked
here rather than by argparse so that every mistake is a one-line `LaunchError`
naming the flag and what is allowed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polytrain.errors import LaunchError
from polytrain.launchers import elastic, registry
from polytrain.launchers.base import (
    SPEC_SUFFIXES,
    HorovodOptions,
    LaunchRequest,
    SlurmOptions,
    launch_spec,
    program_for_target,
)
from polytrain.launchers.hostfile import parse_hosts_string, read_hostfile

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")  # horovodrun's --log-level


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    names = registry.launcher_names()
    parser.add_argument("--launcher", default="local", help=f"one of {', '.join(names)} (default: local)")
    parser.add_argument("-np", "--num-proc", dest="nproc", metavar="N", help="total number of processes")
    parser.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts and slots, e.g. h1:2,h2:2")
    parser.add_argument("--hostfile", metavar="FILE", help="Open MPI hostfile (host slots=N per line)")
    parser.add_argument("--nnodes", metavar="N", help="number of nodes when no hosts are listed (srun, torchrun)")
    parser.add_argument("--master-addr", metavar="ADDR", help="rendezvous / MASTER_ADDR host")
    parser.add_argument("--master-port", metavar="PORT", help="rendezvous / MASTER_PORT (default: a free port)")
    parser.add_argument("--max-restarts", default="0", metavar="K", help="restart the workers up to K times")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, start nothing")
    parser.add_argument(  # SUPPRESS: `polytrain --debug launch` keeps working (the subparser must not reset it)
        "--debug", action="store_true", default=argparse.SUPPRESS,
        help="when a rank fails, show the launcher's own traceback in full (and tracebacks for bad input)",
    )
    for launcher in registry.batch_script_launchers():
        script = launcher.batch_script
        parser.add_argument(script.flag, metavar="FILE", help=script.help)
    parser.add_argument(
        "-x", "--env", action="append", default=[], metavar="VAR[=VALUE]",
        help="export VAR to every worker (without =VALUE: its current value, which then stays off every command "
             "line; a token belongs there); repeatable",
    )
    parser.add_argument("--mpi-flavour", metavar="openmpi|hydra", help="mpirun flavour (default: ask mpirun)")
    parser.add_argument("--ray-address", metavar="ADDR",
                        help="--launcher ray: the Ray cluster to run on (host:port of its head); default: a local Ray, "
                             "started for the job and stopped after it")

    horovod = parser.add_argument_group("horovodrun options")
    controller = horovod.add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="horovod_controller", action="store_const", const="gloo")
    controller.add_argument("--mpi", dest="horovod_controller", action="store_const", const="mpi")
    horovod.add_argument("--network-interfaces", metavar="NIC[,NIC]")
    horovod.add_argument("--start-timeout", metavar="SECONDS")
    horovod.add_argument("--fusion-threshold-mb", metavar="MB")
    horovod.add_argument("--cycle-time-ms", metavar="MS")
    horovod.add_argument("--timeline-filename", metavar="FILE")
    horovod.add_argument("--verbose", dest="horovod_verbose", action="store_true")
    horovod.add_argument("--log-level", dest="horovod_log_level", metavar="LEVEL",
                         help=f"HOROVOD_LOG_LEVEL of every worker: {', '.join(LOG_LEVELS)}")
    parser.add_argument("--elastic", action="store_true",
                        help="an elastic job (--launcher local or horovodrun): polytrain's driver restarts nothing; a "
                             "lost rank's peers go on in place (--min-np, --max-np, --host-discovery-script below)")
    elastic.add_elastic_arguments(parser)

    slurm = parser.add_argument_group("Slurm options (srun, --emit-sbatch)")
    slurm.add_argument("--gpus-per-node", metavar="G")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--time", dest="time_limit", metavar="TIME")
    slurm.add_argument("--job-name", default="polytrain")
    slurm.add_argument("--requeue", action="store_true",
                       help="with --emit-sbatch: #SBATCH --requeue; a spec's run stops at a step with a checkpoint on "
                            "the scheduler's signal, requeues itself and resumes (--resume auto) when it starts again")
    slurm.add_argument("--signal", dest="slurm_signal", metavar="NAME@SECONDS",
                       help="with --emit-sbatch: Slurm signals the job SECONDS before its time limit, e.g. USR1@120 "
                            "(the batch shell passes it on to every task)")

    parser.add_argument(
        "launch_command", nargs=argparse.REMAINDER, metavar="SPEC|SCRIPT.py [ARGS] [-- LAUNCHER ARGS]",
        help="a spec (.yaml/.yml/.toml/.json) run with `polytrain train`, or a Python script",
    )


def _number(value: str | None, flag: str, kind: type = int, minimum: float = 1) -> int | float | None:
    if value is None:
        return None
    try:
        number = kind(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        what = "an integer" if kind is int else "a number"
        raise LaunchError(f"{flag} must be {what} >= {minimum:g}, got {value!r}")
    return number


def _env_pairs(items: list[str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """The -x variables with their values, and the names given without one (their values are this process's:
    they stay off every command line, the dry run's included)."""
    env, from_here = {}, {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            if key not in os.environ:
                raise LaunchError(f"-x {key}: {key} is not set here; give it a value with -x {key}=VALUE")
            value = os.environ[key]
        from_here[key] = not sep  # the last -x of a name decides, as it decides the value
        env[key] = value
    return env, tuple(key for key, inherited in from_here.items() if inherited)


def _split_command(command: list[str]) -> tuple[str, list[str], list[str]]:
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise LaunchError("polytrain launch needs a spec (.yaml/.yml/.toml/.json) or a script (.py) to run")
    target, rest = command[0], command[1:]
    if "--" in rest:
        cut = rest.index("--")
        return target, rest[:cut], rest[cut + 1 :]
    return target, rest, []


def request_from_args(args: argparse.Namespace) -> LaunchRequest:
    """The request ``polytrain launch`` flags describe (nothing is started or looked up)."""
    target, program_args, extra_args = _split_command(list(args.launch_command))
    registry.launcher_class(args.launcher)  # a known name, or the one-line error naming the choices
    if args.hosts is not None and args.hostfile is not None:
        raise LaunchError("give either -H/--hosts or --hostfile, not both")
    # `is not None`: an empty -H "" is a mistake to report, not a flag to ignore
    hosts = (parse_hosts_string(args.hosts) if args.hosts is not None
             else read_hostfile(args.hostfile) if args.hostfile is not None else [])
    nproc = _number(args.nproc, "-np")
    if nproc is None:
        if not hosts:
            raise LaunchError("-np N is required (a positive integer) unless -H/--hostfile gives the slots")
        nproc = sum(slots for _, slots in hosts)
    if args.mpi_flavour not in (None, "openmpi", "hydra"):
        raise LaunchError(f"--mpi-flavour must be openmpi or hydra, got {args.mpi_flavour!r}")
    nics = tuple(nic for nic in (args.network_interfaces or "").split(",") if nic)
    env, env_from_here = _env_pairs(args.env)
    level = getattr(args, "horovod_log_level", None)
    if level is not None:
        if level.upper() not in LOG_LEVELS:
            raise LaunchError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
        env = {"HOROVOD_LOG_LEVEL": level.upper(), **env}
    return LaunchRequest(
        launcher=args.launcher,
        nproc=nproc,
        program=program_for_target(target, program_args),
        hosts=hosts,
        hostfile=str(Path(args.hostfile).resolve()) if args.hostfile else None,
        nnodes=_number(args.nnodes, "--nnodes"),
        extra_args=extra_args,
        env=env,
        env_from_here=env_from_here,
        master_addr=args.master_addr,
        master_port=_number(args.master_port, "--master-port"),
        max_restarts=_number(args.max_restarts, "--max-restarts", minimum=0),
        mpi_flavour=args.mpi_flavour,
        ray_address=args.ray_address,
        horovod=HorovodOptions(
            controller=args.horovod_controller,
            network_interfaces=nics,
            start_timeout=_number(args.start_timeout, "--start-timeout"),
            fusion_threshold_mb=_number(args.fusion_threshold_mb, "--fusion-threshold-mb", minimum=0),
            cycle_time_ms=_number(args.cycle_time_ms, "--cycle-time-ms", float, minimum=0),
            timeline_filename=args.timeline_filename,
            verbose=args.horovod_verbose,
        ),
        slurm=SlurmOptions(
            job_name=args.job_name,
            time=args.time_limit,
            partition=args.partition,
            account=args.account,
            gpus_per_node=_number(args.gpus_per_node, "--gpus-per-node"),
            requeue=bool(getattr(args, "requeue", False)),
            signal=getattr(args, "slurm_signal", None),
        ),
        debug=bool(getattr(args, "debug", False)),
    )


def write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600, also when the file was there before): a
    batch script holds the values of the -x variables, which may be tokens."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(fd, 0o600)
        out.write(text)


def launch_from_args(args: argparse.Namespace) -> int:
    """``polytrain launch``: write the batch script, print the dry run, or run; returns the exit code."""
    from polytrain.launchers.dispatch import run

    req = request_from_args(args)
    table = _spec_elastic(args.launch_command)
    if args.elastic or table is not None or elastic.is_elastic(args):
        return _launch_elastic(args, req, table)
    for launcher in registry.batch_script_launchers():
        flag, target = launcher.batch_script.flag, getattr(args, launcher.batch_script.dest, None)
        if not target:
            continue
        script = launcher().emit_script(req)
        try:
            write_private(target, script)
        except OSError as exc:
            raise LaunchError(f"{flag} {target}: cannot write it ({exc.strerror or exc})") from exc
        print(f"wrote {target}; submit it with: {launcher.batch_script.submit.format(target)}", file=sys.stderr)
        return 0
    if req.slurm.requeue or req.slurm.signal:
        flag = "--requeue" if req.slurm.requeue else "--signal"
        raise LaunchError(f"{flag} goes with --emit-sbatch FILE (a Slurm batch script); under a running launcher, "
                          "the spec's preemption table handles the signals")
    if not args.dry_run:
        check_spec(args.launch_command, local=not req.hosts, world_size=req.nproc)
        paths = _preflight_paths(args.launch_command)
        if paths is not None:
            from polytrain.commands.doctor import preflight

            code = preflight(req, paths)
            if code:
                return code
    return run(req, dry_run=args.dry_run)


def _preflight_paths(command: Sequence[str]) -> list[str] | None:
    """Where the spec ``command`` runs writes (``output``, ``checkpoint.dir``) when it asks for ``preflight: true``;
    None otherwise (a script, a spec not here, or no preflight)."""
    target, program_args, _ = _split_command(list(command))
    if not target.endswith(SPEC_SUFFIXES) or not Path(target).is_file():
        return None
    spec = launch_spec(target, program_args)
    return [spec.output, str(spec.checkpoint_dir)] if spec.preflight else None


#: the launchers whose jobs polytrain's elastic driver runs (--elastic, or a spec's elastic table)
ELASTIC_LAUNCHERS = ("local", "horovodrun")


def _spec_elastic(command: Sequence[str]) -> Any:
    """The ``elastic`` table of the spec ``command`` runs (None: a script, no such table, or a spec not here)."""
    from polytrain.spec.files import readable_with_overrides, set_values

    target, program_args, _ = _split_command(list(command))
    if not target.endswith(SPEC_SUFFIXES) or not Path(target).is_file():
        return None
    # a spec without the table is left to the usual checks (a dry run checks none)
    raw = readable_with_overrides(target, set_values(program_args)) or {}
    return launch_spec(target, program_args).elastic if "elastic" in raw else None


def _launch_elastic(args: argparse.Namespace, req: LaunchRequest, table: Any = None) -> int:
    """An elastic job (--elastic, a spec's ``elastic`` table, or horovodrun's --min-np/--host-discovery-script):
    polytrain's driver (local; horovodrun without Horovod, or ``POLYTRAIN_HOROVOD_IMPL=shim``), else the real
    horovodrun with the same flags. The spec's ``elastic.min_np``/``max_np`` are the defaults of the flags."""
    from polytrain.launchers.dispatch import run

    if req.launcher not in ELASTIC_LAUNCHERS:
        what = ("--elastic" if args.elastic else "elastic (the spec's table)" if table is not None
                else "--min-np/--host-discovery-script")
        raise LaunchError(f"{what}: an elastic job runs under --launcher {' or '.join(ELASTIC_LAUNCHERS)} (polytrain's "
                          f"elastic driver), not {req.launcher}; torchrun/srun restart the whole job instead "
                          f"(--max-restarts, --requeue)")
    if req.launcher == "local" and not args.elastic and table is None:
        raise LaunchError("--min-np/--host-discovery-script make an elastic job: add --elastic (--launcher local) "
                          "or give --launcher horovodrun")
    if table is not None:
        args = argparse.Namespace(**vars(args))
        args.min_np = args.min_np if args.min_np is not None else str(table.min_np)
        args.max_np = args.max_np if args.max_np is not None or table.max_np is None else str(table.max_np)
    options = elastic.options_from_args(args, req.nproc)
    if req.launcher == "horovodrun" and not elastic.uses_driver():
        return run(elastic.with_real_horovodrun(req, options), dry_run=args.dry_run)
    if not args.dry_run:
        check_spec(args.launch_command, local=not req.hosts, world_size=req.nproc)
    return elastic.run_elastic(req, options, dry_run=args.dry_run)


def check_spec(command: Sequence[str], *, local: bool = True, world_size: int | None = None) -> None:
    """Reject a bad spec here, once, rather than in every worker (N copies of the same error, then the
    launcher's own report). Only for specs (not scripts); with remote hosts only when the file is here.

    Nothing the spec names by import path (``package.module:function``: model, loss, metrics, callbacks, data
    factory and transform, a tensor plan) is imported here, only checked for its form: the workers may have a
    PYTHONPATH (``-x PYTHONPATH=...``) this process has not, and a module may do work when imported.
    """
    target, program_args, _ = _split_command(list(command))
    if not target.endswith(SPEC_SUFFIXES) or not (local or Path(target).is_file()):
        return
    spec = launch_spec(target, program_args)
    if world_size is not None and spec.parallel.model_parallel:  # the layout must divide the processes started
        from polytrain.spec.layout import grid_for

        grid_for(spec.parallel, world_size, 0)
