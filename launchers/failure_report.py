"""Which rank failed, on which host, and how: one line when a launched job fails.

Two sources, combined by `choose`:

- the exit board (`exit_board`): each polytrain worker of this host says how it ended — its exit code
  and one-line reason, or nothing at all when a signal killed it — and whether its error only says that
  a collective lost a peer; the `DeathWatch` adds when each silent one disappeared;
- the launcher's own output (`parse_launcher_output`), which names the ranks it saw fail, on any host. Each
  launcher module has the parsers of what its tool prints (``failure_parsers`` of its class: torchrun's
  ``ChildFailedError`` block, Open MPI's and MPICH's abort lines, srun's task lines, DeepSpeed's return
  code, which names no rank); `polytrain launch` reads a job's output with the parsers of every launcher in
  the registry, in its order (`registry.output_reading`): what one layer printed may name the rank (an MPI
  library's abort line under srun).

The rank named is, in this order of preference: one that failed on its own (its own error, or a signal
other than the launcher's SIGTERM) over one stopped by the launcher (SIGTERM/SIGINT) over one whose
error only says it lost a peer; then whichever the launcher saw first; then whichever ended first. A rank
that wrote its end on the board is described by it (its code and error), even when a signal came after
(the launcher stopping it while its interpreter was still exiting).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from polytrain.launchers.exit_board import RankRecord

#: How the launcher stops the other ranks after a failure: a rank that died of these was most likely stopped.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: A worker's exit code for bad input (`polytrain.errors.UserError`), whatever launcher ran it.
BAD_INPUT = 2


@dataclass(frozen=True)
class RankFailure:
    """One rank's end as far as it is known (every field may be unknown: None)."""

    rank: int | None
    host: str | None = None
    code: int | None = None  # its exit code, when it exited
    signal: int | None = None  # the signal that killed it, when it was killed
    reason: str | None = None
    peer_lost: bool = False


def from_status(status: int) -> dict[str, int]:
    """Popen/torchrun style: -N is death by signal N."""
    return {"signal": -status} if status < 0 else {"code": status}


def signal_named(text: str) -> int | None:
    """The signal whose description (``strsignal``: "Killed", "Segmentation fault") or name is ``text``."""
    text = text.strip().removesuffix("(core dumped)").strip().rstrip(".")
    for sig in signal.Signals:
        if text in (sig.name, signal.strsignal(sig)):
            return int(sig)
    return None


def single_spaced(text: str) -> str:
    """Whitespace (line breaks of a wrapped message included) collapsed to single spaces."""
    return " ".join(text.split())


Parser = Callable[[str], list[RankFailure]]


def parse_launcher_output(text: str, parsers: Sequence[Parser]) -> list[RankFailure]:
    """Every failed rank ``parsers`` find in a launcher's output, in the order it saw them; one entry per rank
    (the first parser to name a rank wins)."""
    failures: list[RankFailure] = []
    named: set[int] = set()
    for parse in parsers:
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
        if record.ended and record.code:  # its own account: a signal after it (the launcher stopping a rank on
            # its way out, an abort in interpreter shutdown) is not how it failed
            failure = replace(failure, code=record.code, signal=None, reason=record.reason)
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


def launch_exit_code(launcher_code: int, failure: RankFailure | None) -> int:
    """What `polytrain launch` exits with when its launcher failed with ``launcher_code``: that code, except
    that a rank named for bad input (exit `BAD_INPUT`: a spec field, flag or file it named in one line) makes it
    `BAD_INPUT` — torchrun exits 1 whatever its workers' codes were, and bad input is exit 2 under every
    launcher, as under the local starter and mpirun, which pass a worker's code on."""
    if failure is not None and failure.code == BAD_INPUT and not failure.signal:
        return BAD_INPUT
    return launcher_code


def report_launcher_failure(launcher: str, code: int, records: Mapping[int, RankRecord], output: str,
                            deaths: Mapping[int, float] | None = None,
                            signals: Mapping[int, int] | None = None, *, parsers: Sequence[Parser]) -> int:
    """Say in one line which rank failed and how; returns the launch's exit code (`launch_exit_code`)."""
    failure = choose(records, parse_launcher_output(output, parsers), deaths, signals)
    print(launcher_failure_line(launcher, code, failure), file=sys.stderr, flush=True)
    return launch_exit_code(code, failure)


def report_worker_failure(returncodes: Sequence[int | None], records: Mapping[int, RankRecord]) -> None:
    """The local starter's line, when worker ``returncodes[i]`` (rank i; Popen's: -N for signal N) failed:
    of the workers seen failed, one that did not only lose a peer, the lowest rank first. (Its exit code
    is exact here; its reason is not repeated: the local workers' own error lines are right above.)"""
    failed = [rank for rank, status in enumerate(returncodes) if status]
    rank = min(failed, key=lambda r: (records[r].peer_lost if r in records else False, r))
    failure = RankFailure(rank, **from_status(returncodes[rank] or 0))
    print(f"polytrain launch: rank {rank} {how_it_ended(failure)}; stopping the other {len(returncodes) - 1} "
          f"worker(s)", file=sys.stderr, flush=True)
