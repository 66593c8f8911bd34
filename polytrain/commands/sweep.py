"""``polytrain sweep SPEC --grid KEY=V1,V2 ... --metric M --mode max|min``: a grid of runs of one spec, as Ray Tune
trials.

Every combination of the ``--grid`` values is checked as a spec before Ray starts (a bad one is one line naming
its ``--grid``, exit code 2), then is a trial, repeated ``--samples`` times: ``polytrain train`` (or, with ``-np``
> 1, ``polytrain launch --launcher local -np N``) of the spec with those ``--set`` values, in the working
directory, with its own output directory in the trial's (``<output>/sweep/ray/<trial>/run``). The trial follows the run's ``metrics.jsonl`` and reports each epoch record to
Tune (``tune.report``), so a scheduler (``--scheduler asha``) can stop a trial early (its run is then stopped). A
trial that fails is reported and the others go on. The table of trials (the grid values, the best value of the
metric over each trial's epochs, its status) is printed with the best marked and written as CSV
(``<output>/sweep/sweep.csv``, with the address of the node each trial ran on; the table shows it too when the
trials ran on more than one). Ray is a local one started for the sweep (one CPU per rank of a trial), or the
cluster at ``--ray-address``, whose nodes must all see the output directory (Ray Tune keeps its trials there).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polytrain.errors import SpecError, UserError
from polytrain.observe.metrics import read_records

STATUS_OK, STATUS_FAILED, STATUS_STOPPED = "done", "failed", "stopped early"


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="the spec file every trial runs")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="a spec field and the values it takes (repeatable: every combination is a trial)")
    parser.add_argument("--metric", default="val_accuracy", help="an epoch record's field (default: val_accuracy)")
    parser.add_argument("--mode", default="max", choices=("max", "min"), help="best is its max or min")
    parser.add_argument("--samples", default=1, type=int, metavar="K", help="runs of each combination (default 1)")
    parser.add_argument("-np", dest="nproc", default=1, type=int, metavar="N", help="ranks of each trial (default 1)")
    parser.add_argument("--scheduler", choices=("fifo", "asha"), default="fifo",
                        help="asha: stop trials early that fall behind (Ray Tune's ASHA, over epochs)")
    parser.add_argument("--ray-address", metavar="ADDR", help="the Ray cluster (default: a local Ray for the sweep)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="set a field in every trial")


def grid_points(grids: list[str]) -> list[dict[str, str]]:
    """Every combination of the ``--grid KEY=V1,V2`` values, in order."""
    axes = []
    for grid in grids:
        key, eq, values = grid.partition("=")
        choices = [v.strip() for v in values.split(",") if v.strip()]
        if not eq or not key.strip() or not choices:
            raise UserError(f"--grid {grid}: expected KEY=V1,V2,... (a spec field and the values it takes)")
        axes.append([(key.strip(), value) for value in choices])
    return [dict(point) for point in itertools.product(*axes)] if axes else [{}]


def sweep_from_args(args: argparse.Namespace) -> int:
    from polytrain import validation

    if args.samples < 1 or args.nproc < 1:
        raise UserError(f"{'--samples' if args.samples < 1 else '-np'}: expected a positive integer")
    points = grid_points(args.grid)
    base = validation.load(args.spec, args.set)
    for point in points:  # every trial's spec, checked before anything starts
        try:
            validation.load(args.spec, [*args.set, *(f"{k}={v}" for k, v in point.items())])
        except SpecError as exc:
            raise UserError(f"--grid {', '.join(f'{k}={v}' for k, v in point.items())}: {exc}") from None
    root = Path(base.output).absolute() / "sweep"
    rows = _run_trials(args, points, root)
    best = _best(rows, args.mode)
    _print_table(rows, best, args.metric, [key for key in points[0]])
    root.mkdir(parents=True, exist_ok=True)
    with (root / "sweep.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["trial", *points[0], args.metric, "status", "best", "node",
                                               "output"])
        writer.writeheader()
        for i, row in enumerate(rows):
            writer.writerow({"trial": row["trial"], **row["point"], args.metric: row["value"], "status": row["status"],
                             "best": i == best, "node": row["node"], "output": row["output"]})
    print(f"sweep: {root / 'sweep.csv'}")
    return 0 if best is not None else 1


def _run_trials(args: argparse.Namespace, points: list[dict[str, str]], root: Path) -> list[dict[str, Any]]:
    from polytrain.launchers.ray import import_ray, ray_session

    ray = import_ray()
    from ray import tune

    # the --set values go to each trial through Ray's object store (`tune.with_parameters`), not its param space:
    # Tune writes the param space into every trial's params.json, and a value may hold a credential
    program = {"spec": str(Path(args.spec).absolute()), "nproc": args.nproc, "cwd": os.getcwd()}
    scheduler = None
    if args.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        scheduler = ASHAScheduler(metric=args.metric, mode=args.mode, grace_period=1)
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)  # a failed trial's traceback: the table says it
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's progress boxes: verbose=0 below then prints nothing
    with ray_session(ray, args.ray_address, args.nproc, worker_output=False):
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(_trial, sets=list(args.set)), {"cpu": args.nproc}),
            param_space={"point": tune.grid_search(points), **program},
            tune_config=tune.TuneConfig(num_samples=args.samples, scheduler=scheduler),
            run_config=tune.RunConfig(name="ray", storage_path=str(root), verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=0)))
        results = tuner.fit()
        rows = []
        for number, result in enumerate(results):
            output = Path(result.path) / "run"
            values = [r.get(args.metric) for r in _epochs(output / "metrics.jsonl")]
            values = [v for v in values if isinstance(v, (int, float))]
            value = (max if args.mode == "max" else min)(values) if values else None
            status = STATUS_FAILED if result.error is not None else (
                STATUS_OK if _finished(output) else STATUS_STOPPED)
            rows.append({"trial": number, "point": result.config["point"], "value": value, "status": status,
                         "node": (result.metrics or {}).get("node_ip", ""),  # Tune adds it to each report
                         "output": str(output), "error": _one_line(result.error) if result.error else None})
    return rows


def _trial(config: dict[str, Any], sets: Sequence[str] = ()) -> None:
    """One Tune trial: the spec with the sweep's ``sets`` and the trial's grid point, its output in the trial's
    directory, each epoch record reported to Tune while it runs. A run that fails fails the trial."""
    from ray import tune

    output = Path(tune.get_context().get_trial_dir()) / "run"
    sets = [*sets, *(f"{k}={v}" for k, v in config["point"].items()), f"output={output}"]
    set_args = [a for s in sets for a in ("--set", s)]
    if config["nproc"] > 1:
        cmd = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", str(config["nproc"]),
               config["spec"], "--quiet", *set_args]
    else:
        cmd = [sys.executable, "-m", "polytrain.cli", "train", config["spec"], "--quiet", *set_args]
    output.mkdir(parents=True, exist_ok=True)
    with (output / "sweep-trial.log").open("w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=config["cwd"])
    offset = 0  # how far the run's metrics.jsonl has been read: each poll reads only what it added
    try:
        while True:
            done = process.poll() is not None
            records, offset = read_records(output / "metrics.jsonl", offset)
            for record in records:
                if record.get("event") == "epoch":
                    tune.report({k: v for k, v in record.items() if isinstance(v, (int, float))})
            if done:
                break
            time.sleep(0.2)
    finally:
        if process.poll() is None:  # Tune stopped the trial (a scheduler's decision): stop its run
            process.terminate()
            process.wait(timeout=30)
    if process.returncode != 0:
        lines = (output / "sweep-trial.log").read_text().strip().splitlines()
        raise RuntimeError(f"the trial's run exited with code {process.returncode}: {lines[-1] if lines else ''}")


def _epochs(path: Path) -> list[dict[str, Any]]:
    """The epoch records of a run's metrics.jsonl."""
    return [record for record in read_records(path)[0] if record.get("event") == "epoch"]


def _finished(output: Path) -> bool:
    return (output / "model.safetensors").exists()


def _best(rows: list[dict[str, Any]], mode: str) -> int | None:
    scored = [(row["value"], i) for i, row in enumerate(rows) if row["value"] is not None and row["status"] != STATUS_FAILED]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda pair: pair[0])[1]


def _print_table(rows: list[dict[str, Any]], best: int | None, metric: str, keys: list[str]) -> None:
    nodes = len({row["node"] for row in rows if row["node"]}) > 1  # a trial that never reported has none
    header = ["", "trial", *keys, *(["node"] if nodes else []), metric, "status"]
    table = [[("*" if i == best else ""), str(row["trial"]), *(row["point"][k] for k in keys),
              *([row["node"] or "-"] if nodes else []), "-" if row["value"] is None else f"{row['value']:.4f}",
              row["status"] + (f": {row['error']}" if row["error"] else "")] for i, row in enumerate(rows)]
    widths = [max(len(r[c]) for r in [header, *table]) for c in range(len(header) - 1)]
    for r in [header, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1])
    if best is None:
        print(f"sweep: no trial gave {metric}", file=sys.stderr)


def _one_line(exc: BaseException) -> str:
    """A failed trial's error: from the trial's own line (its run's exit and last line) when Ray's text holds it."""
    text = " ".join(str(exc).split())
    start = text.rfind("the trial's run exited with code")
    return text[start:][:300] if start >= 0 else text[-300:]
