"""``polytrain plan SPEC -np N [--nodes K] [--device-memory 80GiB] [--host-memory SIZE]
[--link intra=GB/s,inter=GB/s | --probe] [--device-tflops T] [--nvme-path DIR] [--json]``: which layouts fit, what
each rank holds and sends per step, and the one to run.

One census of the model (`census.take_census`), then for every candidate (`candidates.candidates`) the memory
(`memory.predict_memory`) and communication (`comms.predict_comms`) predictions, and a step time (the census'
FLOPs at ``--device-tflops`` plus the communication on the ``--link`` model, not overlapped); one ranked table,
the layouts that do not fit marked with the reason, and the recommended one as the ``--set`` overrides that run
it (checked by loading the spec with them). ``--json`` prints the same as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict
from typing import Any

from polytrain.errors import SpecError
from polytrain.plan import candidates as cand
from polytrain.plan.activations import global_batch
from polytrain.plan.comms import Link, compute_seconds, parse_link, predict_comms
from polytrain.plan.memory import Precision, optimizer_state_bytes, predict_memory

DEFAULT_TFLOPS = 100.0
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}


def parse_size(text: str, flag: str = "--device-memory") -> float:
    """``80GiB``, ``40GB``, ``512MiB`` → bytes; a one-line error naming ``flag`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(2).lower() not in UNITS or float(match.group(1)) <= 0:
        raise SpecError(f"{flag}: expected a positive size with a unit (e.g. 80GiB, 40GB, 512MiB), got {text!r}")
    return float(match.group(1)) * UNITS[match.group(2).lower()]


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", default=None, help="YAML/TOML/JSON spec file (default: built-in defaults)")
    parser.add_argument("-np", "--num-proc", dest="nproc", type=int, required=True, metavar="N",
                        help="ranks in the job")
    parser.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes the N ranks are spread over "
                                                                        "(default: 1)")
    parser.add_argument("--device-memory", default="80GiB", metavar="SIZE",
                        help="memory of one device (default: %(default)s)")
    parser.add_argument("--host-memory", default=None, metavar="SIZE",
                        help="memory of one node for its ranks' offloaded states (default: not checked)")
    links = parser.add_mutually_exclusive_group()
    links.add_argument("--link", default=None, metavar="intra=GB/s,inter=GB/s[,host=GB/s][,drive=GB/s]",
                       help="bandwidths of the link model (default: intra=100,inter=12.5,host=25,drive=3)")
    links.add_argument("--probe", action="store_true",
                       help="measure the link model first: a short collective benchmark on the N ranks, started by "
                            "polytrain launch (--launcher, -H)")
    parser.add_argument("--launcher", default="local", help="--probe: the launcher (default: local)")
    parser.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="--probe: hosts and slots, e.g. h1:4,h2:4")
    parser.add_argument("--device-tflops", type=float, default=DEFAULT_TFLOPS, metavar="TFLOP/S",
                        help="compute a device sustains, for the step-time estimate (default: %(default)s)")
    parser.add_argument("--nvme-path", metavar="DIR", default=None,
                        help="a directory on each node's NVMe drive: also weigh ZeRO-3 offloaded there (ZeRO-Infinity)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec field first")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def check_numbers(world: int, nodes: int, tflops: float) -> None:
    """-np, --nodes and --device-tflops, before any work (the census, a --probe run) is spent on them."""
    if world < 1:
        raise SpecError(f"-np: expected a positive number of ranks, got {world}")
    if nodes < 1 or world % nodes:
        raise SpecError(f"--nodes: {nodes} must be positive and divide -np {world} (the same ranks on every node)")
    if not tflops > 0:
        raise SpecError(f"--device-tflops: expected a positive number, got {tflops}")


def commit_bytes(numel: int, optimizer: str, momentum: float) -> int:
    """Host memory per rank for training in place (a spec's ``elastic`` table, `polytrain.train.elastic`): two
    commits — the last whole one and the one being taken into the arrays of the one before — each the parameters
    in fp32 and the optimizer's fp32 state (buffers not counted)."""
    return 2 * numel * (4 + optimizer_state_bytes(optimizer, momentum))


def plan(spec: Any, world: int, nodes: int, device_memory: float, link: Link, census: Any = None,
         tflops: float = DEFAULT_TFLOPS, nvme_path: str | None = None,
         host_memory: float | None = None) -> dict[str, Any]:
    """Every candidate's prediction, ranked, and the recommendation (a JSON-ready document); ``census``: one taken
    already for this spec and world size (`census.take_census`); ``host_memory``: one node's memory for its ranks'
    offloaded states (None: not checked)."""
    from polytrain.plan.census import take_census

    check_numbers(world, nodes, tflops)
    census = census or take_census(spec, world)
    # every layout trains on the global batch the spec means on ``world`` data-parallel ranks
    samples = global_batch(spec.data.batch_size, spec.data.global_batch_size, world, spec.loop.grad_accum_steps)
    predictions = [predict(spec, census, layout, world, nodes, link, tflops=tflops, step_samples=samples)
                   for layout in cand.candidates(spec, census, world, nodes, samples, nvme_path)]
    limits = (device_memory, host_memory, world // nodes)
    ranked = cand.rank(predictions, *limits)
    rows = [_row(spec, p, limits, samples) for p in ranked]
    best = next((r for r in rows if r["fits"]), None)
    if best is not None:
        _check_overrides(spec, best["set"])
    commits = None if spec.elastic is None else \
        commit_bytes(census.numel, spec.optimizer.name, spec.optimizer.momentum)
    return {"model": census.model, "parameters": census.numel, "world_size": world, "nodes": nodes,
            "device_memory": device_memory, "host_memory": host_memory, "precision": spec.precision,
            "optimizer": spec.optimizer.name, "link": asdict(link), "device_tflops": tflops, "layouts": rows,
            "recommended": best, "elastic_commit_bytes": commits}


def predict(spec: Any, census: Any, layout: Any, world: int, nodes: int = 1, link: Link | None = None,
            rank: int | None = None, tflops: float = DEFAULT_TFLOPS, step_samples: int | None = None) -> Any:
    """One layout's `memory.Prediction`, its communication and step time filled in (the worst rank, or ``rank``);
    ``step_samples``: the global batch (default: what the spec means in this layout)."""
    from polytrain.spec.layout import ParallelSpec, grid_for

    precision = Precision(spec.precision, optimizer_state_bytes(spec.optimizer.name, spec.optimizer.momentum))
    options = {**cand.backend_options(spec), "per_node": world // nodes}
    stage = None
    if rank is not None:
        grid = grid_for(ParallelSpec(tensor=layout.tensor, pipeline=layout.pipeline), world, rank)
        stage, options["data_rank"] = (grid.stage if layout.pipeline > 1 else None), grid.data_rank
    accum, m = spec.loop.grad_accum_steps, spec.parallel.microbatches
    options["accum"] = accum
    samples = step_samples or global_batch(spec.data.batch_size, spec.data.global_batch_size, layout.data, accum)
    batch = samples / (layout.data * accum)
    pred = predict_memory(census, layout, precision, batch=batch, options=options, microbatches=m,
                          schedule=spec.parallel.schedule, stage=stage)
    traffic = predict_comms(census, layout, precision, batch=batch, accum=accum, nodes=nodes, world=world,
                            options=options, microbatches=m, stage=stage)
    pred.comm, pred.wire, pred.comm_seconds = traffic.payload(), traffic.wire(), traffic.seconds(link or Link())
    pred.compute_seconds = compute_seconds(census, layout, batch=batch, accum=accum, microbatches=m, tflops=tflops)
    return pred


def _row(spec: Any, pred: Any, limits: tuple[float, float | None, int], samples: int) -> dict[str, Any]:
    return {"layout": pred.layout.name, "fits": cand.fits(pred, *limits), "reason": cand.why_not(pred, *limits),
            "device_bytes": pred.device, "parameters": pred.params, "gradients": pred.grads,
            "optimizer_state": pred.optimizer, "master_copies": pred.master, "activations": pred.activations,
            "temporary": dict(pred.temporary), "host_bytes": pred.host, "drive_bytes": pred.drive,
            "micro_batch": pred.micro_batch,
            "comm_payload": dict(pred.comm), "comm_sent_bytes": pred.wire, "comm_seconds": pred.comm_seconds,
            "compute_seconds": pred.compute_seconds, "step_seconds": pred.step_seconds,
            "set": cand.overrides(spec, pred.layout, samples), **{"grid": [pred.layout.pipeline, pred.layout.data,
                                                                 pred.layout.tensor]}}


def _check_overrides(spec: Any, overrides: list[str]) -> None:
    """The recommended overrides must load (the same rules a run checks)."""
    from polytrain import validation
    from polytrain.spec.files import apply_overrides

    validation.from_dict(apply_overrides(spec.to_dict(), overrides))


def table(doc: dict[str, Any]) -> str:
    """The ranked table and the recommendation, for a terminal."""
    g = cand.gib
    lines = [f"{doc['model']}: {doc['parameters']:,} parameters, {doc['precision']}, {doc['optimizer']}; "
             f"{doc['world_size']} ranks on {doc['nodes']} node(s), {g(doc['device_memory'])} per device, "
             + (f"{g(doc['host_memory'])} per node for offloaded states; " if doc["host_memory"] is not None else
                "host memory not checked (--host-memory); ") + "per rank (the worst), per optimizer step"]
    drives = any(row["drive_bytes"] for row in doc["layouts"])  # a drive column only where a layout uses one
    drive_head = f" {'drive':>10}" if drives else ""

    def drive(row: dict[str, Any]) -> str:
        return f" {g(row['drive_bytes']):>10}" if drives else ""

    head = (f"{'#':>3} {'layout':38} {'device':>10} {'params':>10} {'grads':>10} {'optim':>10} {'activ':>10} "
            f"{'temp':>10} {'host':>10}{drive_head} {'sent/step':>10} {'comm ms':>8} {'step ms':>8}  fits")
    lines.append(head)
    for i, row in enumerate(doc["layouts"], 1):
        optim = row["optimizer_state"] + row["master_copies"]
        temp = sum(row["temporary"].values())
        lines.append(f"{i:>3} {row['layout']:38} {g(row['device_bytes']):>10} {g(row['parameters']):>10} "
                     f"{g(row['gradients']):>10} {g(optim):>10} {g(row['activations']):>10} {g(temp):>10} "
                     f"{g(row['host_bytes']):>10}{drive(row)} {g(row['comm_sent_bytes']):>10} "
                     f"{row['comm_seconds'] * 1e3:8.2f} "
                     f"{row['step_seconds'] * 1e3:8.2f}  "
                     f"{'yes' if row['fits'] else 'no: ' + row['reason']}")
    if doc.get("elastic_commit_bytes") is not None:
        lines.append(f"elastic commits: {g(doc['elastic_commit_bytes'])} of host memory per rank (two copies of the "
                     "model and its optimizer state; ddp, fsdp and horovod train in place)")
    best = doc["recommended"]
    if best is None:
        lines.append("recommended: none fits; use more ranks or devices with more memory")
    else:
        sets = " ".join(f"--set {s}" for s in best["set"]) or "(the spec as it is)"
        lines.append(f"recommended: {best['layout']}  {sets}")
    return "\n".join(lines)


def plan_from_args(args: argparse.Namespace) -> int:
    """``polytrain plan``: exit 0 with the table (or JSON); bad input is one line, exit 2 (`SpecError`)."""
    from polytrain import validation

    limit = parse_size(args.device_memory)
    host = parse_size(args.host_memory, "--host-memory") if args.host_memory is not None else None
    link = parse_link(args.link) if args.link is not None else Link()
    spec = validation.load(args.spec, args.set or ())
    check_numbers(args.nproc, args.nodes, args.device_tflops)
    named = [name for name in (args.hosts or "").split(",") if name.strip()]
    if args.probe and named and len(named) != args.nodes:
        raise SpecError(f"--nodes: {args.nodes}, but -H names {len(named)} host(s); the probe measures the links "
                        f"of the hosts the plan is for (give --nodes {len(named)})")
    if args.probe:
        from polytrain.plan.probe import probe_link

        link = probe_link(args.nproc, args.launcher, args.hosts, link)
    doc = plan(spec, args.nproc, args.nodes, limit, link, tflops=args.device_tflops, nvme_path=args.nvme_path,
               host_memory=host)
    print(json.dumps(doc, indent=2) if args.json else table(doc))
    return 0
