"""``polytrain doctor -np N [-H HOSTS] [--launcher L]``: a pre-flight check that names the sick rank, link or host
before a job spends its allocation.

The measurements run on the job's own ranks, started by ``polytrain launch`` as the job would be
(`polytrain.plan.health`); rank 0 relays them. Then each is judged against the others:

- a rank whose matrix-multiply rate is below ``--min-ratio`` (0.5) of the ranks' median;
- a link of the ring whose bandwidth is below ``--min-ratio`` of the median of its kind (within a host, between
  hosts), or whose latency is above the median over ``--min-ratio``; a link of a slow rank is not judged (the
  rank explains it), and a kind with a single link has nothing to be compared with;
- library versions or ``NCCL_*``/``GLOO_*`` variables that differ between ranks;
- a clock more than ``--max-clock-skew`` seconds (1) from rank 0's, beyond the measurement's uncertainty;
- less than ``--min-free-gb`` (1) free under a ``--path`` (default: the current folder) on some rank.

One table, the records and findings as JSON with ``--json FILE``, and the exit code: 0 when nothing is below the
bar, 1 when something is (each finding one line naming the rank, host or link), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from polytrain.errors import UserError


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-np", "--num-proc", dest="nproc", type=int, required=True, metavar="N", help="ranks")
    parser.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts and slots, e.g. h1:4,h2:4")
    parser.add_argument("--launcher", default="local", help="the launcher the job will use (default: local)")
    parser.add_argument("--path", action="append", metavar="DIR", help="a folder the job writes (output, "
                        "checkpoint.dir): its free space on every rank (default: the current folder)")
    parser.add_argument("--min-ratio", type=float, default=0.5, metavar="R",
                        help="a rank or link below R times the median is named (default: %(default)s)")
    parser.add_argument("--min-free-gb", type=float, default=1.0, metavar="GB", help="default: %(default)s")
    parser.add_argument("--max-clock-skew", type=float, default=1.0, metavar="SECONDS", help="default: %(default)s")
    parser.add_argument("--gemm-seconds", type=float, default=0.6, metavar="S",
                        help="how long each rank's matrix multiply is sustained (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="write the records and findings here")


def check_arguments(args: argparse.Namespace) -> None:
    """Bad input as a one-line `UserError` (exit 2), before any rank starts."""
    from polytrain.launchers import registry
    from polytrain.launchers.hostfile import parse_hosts_string

    if args.nproc < 1:
        raise UserError(f"-np: {args.nproc}; the number of ranks to check, at least 1")
    if args.launcher not in registry.launcher_names():
        raise UserError(f"--launcher: {args.launcher!r} is not one of {', '.join(registry.launcher_names())}")
    if args.hosts is not None:
        hosts = parse_hosts_string(args.hosts)
        if args.nproc > sum(slots for _, slots in hosts):
            raise UserError(f"-np {args.nproc} is more than the {sum(s for _, s in hosts)} slots -H {args.hosts} "
                            "gives")
    if not 0 < args.min_ratio < 1:
        raise UserError(f"--min-ratio: {args.min_ratio}; a fraction of the median, between 0 and 1")
    if args.min_free_gb < 0 or args.max_clock_skew <= 0 or not 0 < args.gemm_seconds <= 600:
        raise UserError("--min-free-gb must be >= 0, --max-clock-skew > 0 and --gemm-seconds in (0, 600]")


def run_checks(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every rank's record, from a ``polytrain launch`` of `polytrain.plan.health`; a job that fails is a
    `UserError` naming the launcher and its last line."""
    from polytrain.plan import health

    paths = args.path or ["."]
    cmd = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", args.launcher, "-np", str(args.nproc),
           *(["-H", args.hosts] if args.hosts else []), health.__file__,
           *[a for path in paths for a in ("--path", str(Path(path).absolute()))],
           "--gemm-seconds", str(args.gemm_seconds)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = re.search(rf"^{health.MARK} (\[.*\])$", done.stdout, re.M)
    if done.returncode != 0 or found is None:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        raise UserError(f"doctor: the check job failed under {args.launcher} (exit {done.returncode}): "
                        f"{said[-1] if said else 'no output'}")
    return json.loads(found.group(1))


def _who(record: dict[str, Any]) -> str:
    return f"rank {record['rank']} on host {record['host']}"


def judge(records: list[dict[str, Any]], min_ratio: float, min_free_gb: float, max_skew: float) -> list[str]:
    """What is below the bar, one line each (see the module's docstring)."""
    findings: list[str] = []
    by_rank = {r["rank"]: r for r in records}
    rates = [r["gemm_gflops"] for r in records]
    median = statistics.median(rates)
    slow = {r["rank"] for r in records if r["gemm_gflops"] < min_ratio * median}
    findings += [f"{_who(by_rank[rank])}: matrix multiply at {by_rank[rank]['gemm_gflops']:.3g} GFLOP/s, below "
                 f"{min_ratio:g} of the ranks' median {median:.3g}" for rank in sorted(slow)]
    findings += _judge_links(records, by_rank, slow, min_ratio)
    for key in ("versions", "env"):
        names = sorted({name for r in records for name in r[key]})
        for name in names:
            values = {r["rank"]: r[key].get(name) for r in records}
            if len(set(values.values())) > 1:
                where = "; ".join(f"{value!r} on rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
                                  for value, ranks in _ranks_by_value(values).items())
                findings.append(f"{'library ' + name if key == 'versions' else name} differs between ranks: {where}")
    offsets = by_rank[min(by_rank)].get("clock_offsets", {})
    for peer, clock in sorted(offsets.items(), key=lambda item: int(item[0])):
        if abs(clock["offset_s"]) - clock["uncertainty_s"] > max_skew:  # off by more than the bound, surely
            findings.append(f"{_who(by_rank[int(peer)])}: clock {clock['offset_s']:+.3f} s (±"
                            f"{clock['uncertainty_s']:.3f}) from rank 0's, more than {max_skew:g} s")
    findings += [f"{_who(r)}: {free:.3g} GB free under {path}, below {min_free_gb:g} GB" for r in records
                 for path, free in r["free_gb"].items() if free is not None and free < min_free_gb]
    return findings


def _judge_links(records: list[dict[str, Any]], by_rank: dict[int, dict[str, Any]], slow: set[int],
                 min_ratio: float) -> list[str]:
    links = [(r["rank"], int(peer), value) for r in records for peer, value in r.get("links", {}).items()]
    judged = [(a, b, v) for a, b, v in links if a not in slow and b not in slow]
    findings = []
    for kind in (True, False):  # within a host, then between hosts: loopback and a wire are not compared
        same = [(a, b, v) for a, b, v in judged if (by_rank[a]["host"] == by_rank[b]["host"]) == kind]
        if len(same) < 2:
            continue
        bandwidth = statistics.median(v["gbs"] for _, _, v in same)
        latency = statistics.median(v["latency_us"] for _, _, v in same)
        for a, b, v in same:
            link = f"link rank {a} ({by_rank[a]['host']}) <-> rank {b} ({by_rank[b]['host']})"
            if v["gbs"] < min_ratio * bandwidth:
                findings.append(f"{link}: {v['gbs']:.3g} GB/s, below {min_ratio:g} of the median {bandwidth:.3g} "
                                f"of the links {'within' if kind else 'between'} hosts")
            elif v["latency_us"] > latency / min_ratio:
                findings.append(f"{link}: latency {v['latency_us']:.3g} us, above the median {latency:.3g} us over "
                                f"{min_ratio:g}")
    return findings


def _ranks_by_value(values: dict[int, Any]) -> dict[Any, list[int]]:
    grouped: dict[Any, list[int]] = {}
    for rank, value in sorted(values.items()):
        grouped.setdefault(value, []).append(rank)
    return grouped


def table(records: list[dict[str, Any]]) -> str:
    rows = [("rank", "host", "GEMM GFLOP/s", "link GB/s", "latency us", "all-reduce GB/s", "clock s", "free GB")]
    offsets = min(records, key=lambda r: r["rank"]).get("clock_offsets", {})
    for r in sorted(records, key=lambda r: r["rank"]):
        link = next(iter(r.get("links", {}).values()), None)
        free = [v for v in r["free_gb"].values() if v is not None]
        rows.append((str(r["rank"]), r["host"], f"{r['gemm_gflops']:.3g}", f"{link['gbs']:.3g}" if link else "-",
                     f"{link['latency_us']:.3g}" if link else "-",
                     f"{r['allreduce_gbs']:.3g}" if r.get("allreduce_gbs") else "-",
                     f"{offsets.get(str(r['rank']), {}).get('offset_s', 0.0):+.3f}",
                     f"{min(free):.3g}" if free else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def doctor_from_args(args: argparse.Namespace) -> int:
    check_arguments(args)
    records = run_checks(args)
    findings = judge(records, args.min_ratio, args.min_free_gb, args.max_clock_skew)
    print(table(records))
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": records, "findings": findings}, indent=1) + "\n")
    for line in findings:
        print(f"polytrain doctor: {line}", file=sys.stderr)
    if not findings:
        print(f"polytrain doctor: {len(records)} rank(s): nothing below the bar")
    return 1 if findings else 0


def preflight(req: Any, paths: list[str]) -> int:
    """``preflight: true``: the doctor on the ranks ``req`` (a `LaunchRequest`) will start, with the default bars;
    0 when nothing is below them, else 1 after naming what is (the job is not started)."""
    from polytrain.launchers.hostfile import to_hosts_string

    print(f"polytrain launch: preflight: polytrain doctor on the job's {req.nproc} rank(s) first", file=sys.stderr,
          flush=True)
    args = argparse.Namespace(nproc=req.nproc, hosts=to_hosts_string(req.hosts) if req.hosts else None,
                              launcher=req.launcher, path=paths, min_ratio=0.5, min_free_gb=1.0, max_clock_skew=1.0,
                              gemm_seconds=0.6, json=None)
    code = doctor_from_args(args)
    if code:
        print("polytrain launch: preflight: the job was not started (see the findings above)", file=sys.stderr)
    return code
