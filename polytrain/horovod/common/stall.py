"""Horovod's stall warning, worded as Horovod 0.28.1's ``stall_inspector.cc`` words it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def stall_message(missing: Mapping[int, Iterable[str]], waited_seconds: float, shutdown: bool = False) -> str:
    """Horovod's stall warning: which ranks have not submitted which tensors.

    ``missing`` maps a global rank to the names of the tensors it has not submitted yet.
    """
    lines = [
        "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks "
        f"and are waiting for remainder of ranks for more than {waited_seconds:.0f} seconds. This may "
        "indicate that different ranks are trying to submit different tensors or that only subset of "
        "ranks is submitting tensors, which will cause deadlock.",
        "Missing ranks:",
    ]
    for rank in sorted(missing):
        names = sorted(missing[rank])
        shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
        lines.append(f"{rank}{'!' if shutdown else ''}: [{shown}]")
    if shutdown:
        lines.append(f"One or more rank (marked by \"!\") is stalled for longer than {waited_seconds:.0f} "
                     "seconds. Will shutdown.")
    return "\n".join(lines)
