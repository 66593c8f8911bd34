"""Which rank failed, on which host, and how: one line when a launched job fails.

Two sources, combined by `choose`:

- the exit board (`exit_board`): each polytrain worker of this host says how it ended — its exit code
  and one-line reason, or nothing at all when a signal killed it — and whether its error only says that
  a collective lost a peer; the `DeathWatch` adds when each silent one disappeared;
- the launcher's own output (`parse_launcher_output`), which names the ranks it saw fail, on any host:
  torchrun's ``ChildFailedError`` block (root cause first), Open MPI's "process rank 1 ... exited on
  signal 9" / "Process name: [...,1] Exit code: 3" / "MPI_ABORT was invoked on rank 1", MPICH/Intel MPI's
  "RANK 1 PID ... RUNNING AT host ... KILLED BY SIGNAL: 9", srun's "srun: error: host: task 1: Killed",
  and DeepSpeed's "... exits with return code = -9" (which does not say which rank).

The rank named is, in this order of preference: one that failed on its own (its own error, or a signal
other than the launcher's SIGTERM) over one stopped by the launcher (SIGTERM/SIGINT) over one whose
error only says it lost a peer; then whichever the launcher saw first; then whichever ended first.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from polytrain.launchers.exit_board import RankRecord

#: How the launcher stops the other ranks after a failure: a rank that died of these was most likely stopped.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class RankFailure:
    """One rank's end as far as it is known (every field may be unknown: None)."""

    rank: int | None
    host: str | None = None
    code: int | None = None  # its exit code, when it exited
    signal: int | None = None  # the signal that killed it, when it was killed
    reason: str | None = None
    peer_lost: bool = False


def _from_status(status: int) -> dict[str, int]:
    """Popen/torchrun style: -N is death by signal N."""
    return {"signal": -status} if status < 0 else {"code": status}


def _signal_named(text: str) -> int | None:
    """The signal whose description (``strsignal``: "Killed", "Segmentation fault") or name is ``text``."""
    text = text.strip().removesuffix("(core dumped)").strip().rstrip(".")
    for sig in signal.Signals:
        if text in (sig.name, signal.strsignal(sig)):
            return int(sig)
    return None


def _flat(text: str) -> str:
    """Whitespace (line breaks of a wrapped message included) collapsed to single spaces."""
    return " ".join(text.split())


_TORCHRUN_ENTRY = re.compile(r"host\s*:\s*(\S+)\s*\n\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
_TORCHRUN_LOG = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def parse_torchrun(text: str) -> list[RankFailure]:
    """torchrun's ``ChildFailedError`` block: the root cause, then the other failures; else its log lines
    ("failed (exitcode: -9) local_rank: 1", right for the single node `polytrain launch` runs)."""
    failures: list[RankFailure] = []
    start = text.rfind("ChildFailedError")
    if start >= 0:
        block = text[start:]
        cause_at = block.find("Root Cause")
        parts = [block[cause_at:], block[:cause_at]] if cause_at >= 0 else [block]
        for part in parts:
            for host, rank, status in _TORCHRUN_ENTRY.findall(part):
                failures.append(RankFailure(int(rank), host, **_from_status(int(status))))
    if not failures:
        for status, rank in _TORCHRUN_LOG.findall(text):
            failures.append(RankFailure(int(rank), **_from_status(int(status))))
    return failures


_OMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_OMPI_EXIT = re.compile(r"The first process to do so was: Process name: \[(?:\[[^\]]*\]|[^\],]*),(\d+)\]"
                        r"(?: Node: (\S+))? Exit code: (\d+)")
_OMPI_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+(?: with errorcode (\d+))?"
                         r"(?:.{0,200}?Errorcode: (\d+))?")


def parse_openmpi(text: str) -> list[RankFailure]:
    flat = _flat(text)
    found = [(m.start(), RankFailure(int(m[1]), m[2], signal=int(m[3]))) for m in _OMPI_SIGNAL.finditer(flat)]
    found += [(m.start(), RankFailure(int(m[1]), m[2], code=int(m[3]))) for m in _OMPI_EXIT.finditer(flat)]
    for m in _OMPI_ABORT.finditer(flat):
        code = m[2] or m[3]
        found.append((m.start(), RankFailure(int(m[1]), code=None if code is None else int(code))))
    return [failure for _, failure in sorted(found, key=lambda item: item[0])]


_HYDRA = re.compile(r"(?:RANK (\d+) )?PID \d+ RUNNING AT (\S+) =? ?(?:KILLED BY SIGNAL: (\d+)|EXIT CODE: (\d+))")


def parse_hydra(text: str) -> list[RankFailure]:
    """MPICH / Intel MPI (hydra): "BAD TERMINATION ... RANK 1 PID 7 RUNNING AT host = KILLED BY SIGNAL: 9"."""
    failures = []
    for rank, host, sig, code in _HYDRA.findall(_flat(text)):
        failures.append(RankFailure(int(rank) if rank else None, host, code=int(code) if code else None,
                                    signal=int(sig) if sig else None))
    return failures


_SRUN = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+?)\s*$", re.MULTILINE)
_SRUN_EXIT = re.compile(r"Exited with exit code (\d+)")


def _task_ids(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        if first.isdigit():
            ids += range(int(first), int(last) + 1) if last.isdigit() else [int(first)]
    return ids


def parse_srun(text: str) -> list[RankFailure]:
    """srun's "srun: error: node1: task 1: Killed" and "...: tasks 0-1: Exited with exit code 2" lines."""
    failures = []
    for host, tasks, status in _SRUN.findall(text):
        exited = _SRUN_EXIT.search(status)
        how = {"code": int(exited[1])} if exited else {"signal": _signal_named(status)}
        failures += [RankFailure(task, host, **how) for task in _task_ids(tasks)]
    return failures


_DEEPSPEED = re.compile(r"^(?:([\w.\-]+): )?.*exits with return code = (-?\d+)\s*$", re.MULTILINE)


def parse_deepspeed(text: str) -> list[RankFailure]:
    """DeepSpeed's launcher logs the return code of the first worker it saw fail, not its rank
    (with pdsh, the line starts with the host's name)."""
    return [RankFailure(None, host or None, **_from_status(int(status))) for host, status in _DEEPSPEED.findall(text)]


PARSERS = (parse_torchrun, parse_openmpi, parse_hydra, parse_srun, parse_deepspeed)


def parse_launcher_output(text: str) -> list[RankFailure]:
    """Every failed rank a launcher's output names, in the order it saw them; one entry per rank."""
    failures: list[RankFailure] = []
    named: set[int] = set()
    for parse in PARSERS:
        for failure in parse(text):
            if failure.rank is None or failure.rank not in named:
                failures.append(failure)
                if failure.rank is not None:
                    named.add(failure.rank)
    return failures


def choose(records: Mapping[int, RankRecord], seen: Sequence[RankFailure],
           deaths: Mapping[int, float] | None = None, signals: Mapping[int, int] | None = None) -> RankFailure | None:
    """The rank to name (see the module doc), with all that is known of its end; None when nothing is.
    ``deaths``/``signals``: when each silent rank of this host died, and of which signal where seen."""
    deaths = deaths or {}
    signals = signals or {}
    first_seen = {}
    for index, failure in enumerate(seen):
        if failure.rank is not None:
            first_seen.setdefault(failure.rank, (index, failure))
    ranked = []
    for rank in set(records) | set(first_seen):
        record = records.get(rank)
        index, fact = first_seen.get(rank, (len(seen), None))
        if record is not None and record.ended and not record.code and fact is None:
            continue  # ended cleanly
        if record is not None and record.ended and record.code and record.peer_lost:
            tier = 2
        elif record is not None and record.ended and record.code:
            tier = 0
        elif (fact.signal if fact is not None else signals.get(rank)) in STOP_SIGNALS:
            tier = 1
        else:
            tier = 0
        when = record.end if record is not None and record.ended else deaths.get(rank, float("inf"))
        ranked.append(((tier, index, when, rank), rank, record, fact))
    anonymous = next((f for f in seen if f.rank is None), None)
    if not ranked:
        return anonymous
    _, rank, record, fact = min(ranked, key=lambda item: item[0])
    failure = fact or RankFailure(rank)
    if record is not None:
        failure = replace(failure, host=record.host, peer_lost=record.peer_lost)
        if record.ended and record.code:
            failure = replace(failure, code=None if failure.signal else record.code, reason=record.reason)
        elif fact is None and rank in signals:
            failure = replace(failure, signal=signals[rank])
        elif fact is None and anonymous is not None and anonymous.signal and anonymous.signal not in STOP_SIGNALS:
            # the launcher saw a worker die this way without saying which; this one died first
            failure = replace(failure, code=anonymous.code, signal=anonymous.signal)
    return failure


def how_it_ended(failure: RankFailure) -> str:
    if failure.signal:
        try:
            name = signal.Signals(failure.signal).name
        except ValueError:
            name = f"signal {failure.signal}"
        how = f"was killed by {name}"
    elif failure.code is not None:
        how = f"exited with code {failure.code}"
    else:
        how = "ended without a word (killed by a signal such as SIGKILL, or the out-of-memory killer)"
    return how + (f" ({failure.reason})" if failure.reason else "")


def launcher_failure_line(launcher: str, code: int, failure: RankFailure | None) -> str:
    """The line `polytrain launch` prints when ``launcher`` ended with a non-zero ``code``."""
    if failure is None:
        return f"polytrain launch: {launcher} exited with code {code}; no rank said how it ended"
    if failure.rank is None:
        who = "a rank" + (f" on host {failure.host}" if failure.host else "")
        return f"polytrain launch: {who} {how_it_ended(failure)} ({launcher} does not say which); " \
               f"{launcher} exited with code {code}"
    where = f" on host {failure.host}" if failure.host else ""
    return f"polytrain launch: rank {failure.rank}{where} {how_it_ended(failure)}; {launcher} exited with code {code}"


def report_launcher_failure(launcher: str, code: int, records: Mapping[int, RankRecord], output: str,
                            deaths: Mapping[int, float] | None = None,
                            signals: Mapping[int, int] | None = None) -> None:
    failure = choose(records, parse_launcher_output(output), deaths, signals)
    print(launcher_failure_line(launcher, code, failure), file=sys.stderr, flush=True)


def report_worker_failure(returncodes: Sequence[int | None], records: Mapping[int, RankRecord]) -> None:
    """The local starter's line, when worker ``returncodes[i]`` (rank i; Popen's: -N for signal N) failed:
    of the workers seen failed, one that did not only lose a peer, the lowest rank first. (Its exit code
    is exact here; its reason is not repeated: the local workers' own error lines are right above.)"""
    failed = [rank for rank, status in enumerate(returncodes) if status]
    rank = min(failed, key=lambda r: (records[r].peer_lost if r in records else False, r))
    failure = RankFailure(rank, **_from_status(returncodes[rank] or 0))
    print(f"polytrain launch: rank {rank} {how_it_ended(failure)}; stopping the other {len(returncodes) - 1} "
          f"worker(s)", file=sys.stderr, flush=True)
