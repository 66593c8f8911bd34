"""horovodrun's elastic flags: which make a job elastic, and checking them (bad input: one line, exit 2)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from polytrain.errors import LaunchError

DEFAULT_ELASTIC_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """What ``horovodrun -np N --min-np ... --host-discovery-script ...`` asks of the driver."""

    np: int
    min_np: int
    max_np: int | None = None
    discovery_script: str | None = None
    slots_per_host: int | None = None
    reset_limit: int | None = None
    cooldown: tuple[int, int] | None = None
    elastic_timeout_s: float = DEFAULT_ELASTIC_TIMEOUT_S

    def flags(self) -> list[str]:
        """The same options as horovodrun flags (for the real horovodrun)."""
        out = ["--min-np", str(self.min_np)]
        for flag, value in (("--max-np", self.max_np), ("--host-discovery-script", self.discovery_script),
                            ("--slots-per-host", self.slots_per_host), ("--reset-limit", self.reset_limit),
                            ("--elastic-timeout", self.elastic_timeout_s)):
            if value is not None:
                out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        if self.cooldown is not None:
            out += ["--blacklist-cooldown-range", str(self.cooldown[0]), str(self.cooldown[1])]
        return out


def add_elastic_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("horovodrun elastic options (an elastic job: --min-np or a discovery script)")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", metavar="N",
                       help="fewest processes the job runs with (default: -np)")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", metavar="N",
                       help="most processes (default: every discovered slot)")
    group.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="executable printing HOST[:SLOTS] lines, run every second")
    group.add_argument("--slots-per-host", "--slots", dest="slots_per_host", metavar="N",
                       help="slots of a discovered HOST line without :SLOTS (default 1)")
    group.add_argument("--reset-limit", metavar="N", help="most re-formations before the job fails")
    group.add_argument("--blacklist-cooldown-range", nargs=2, metavar=("MIN", "MAX"),
                       help="seconds a failed host stays out (exponential backoff within MIN..MAX); default: for good")
    group.add_argument("--elastic-timeout", metavar="SECONDS",
                       help="how long to wait for --min-np slots (default: HOROVOD_ELASTIC_TIMEOUT, else 600)")


def is_elastic(args: argparse.Namespace) -> bool:
    """Horovod's ``_is_elastic``: a discovery script or --min-np makes the job elastic (--max-np alone does not)."""
    return getattr(args, "host_discovery_script", None) is not None or getattr(args, "min_np", None) is not None


def _whole(value: str | None, flag: str, minimum: int) -> int | None:
    if value is None:
        return None
    text = str(value).strip()
    if not (text.isascii() and text.lstrip("-").isdigit()) or int(text) < minimum:
        raise LaunchError(f"{flag} must be a whole number >= {minimum}, got {value!r}")
    return int(text)


def _seconds(value: str, flag: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise LaunchError(f"{flag} must be a number of seconds > 0, got {value!r}")
    return seconds


def options_from_args(args: argparse.Namespace, np: int) -> ElasticOptions:
    """The elastic options of ``polytrain launch`` flags (``np``: -np as read); LaunchError on bad input."""
    min_np = _whole(args.min_np, "--min-np", 1)
    max_np = _whole(args.max_np, "--max-np", 1)
    min_np = np if min_np is None else min_np
    if max_np is not None and min_np > max_np:
        raise LaunchError(f"--min-np {min_np} is more than --max-np {max_np}: the job could never start")
    if np < min_np or (max_np is not None and np > max_np):
        high = max_np if max_np is not None else "any"
        raise LaunchError(f"-np {np} must be within --min-np {min_np} .. --max-np {high}")
    cooldown = None
    if args.blacklist_cooldown_range is not None:
        lo_text, hi_text = args.blacklist_cooldown_range
        lo = _whole(lo_text, "--blacklist-cooldown-range MIN", 1)
        hi = _whole(hi_text, "--blacklist-cooldown-range MAX", 1)
        assert lo is not None and hi is not None
        if lo > hi:
            raise LaunchError(f"--blacklist-cooldown-range {lo} {hi}: MIN is more than MAX")
        if hi > 3600:
            raise LaunchError(f"--blacklist-cooldown-range MAX must be at most 3600 seconds, got {hi}")
        cooldown = (lo, hi)
    if args.host_discovery_script is not None and (args.hosts is not None or args.hostfile is not None):
        raise LaunchError("give either --host-discovery-script or -H/--hostfile, not both")
    timeout_text = args.elastic_timeout or os.environ.get("HOROVOD_ELASTIC_TIMEOUT")
    flag = "--elastic-timeout" if args.elastic_timeout else "HOROVOD_ELASTIC_TIMEOUT"
    return ElasticOptions(
        np=np, min_np=min_np, max_np=max_np, discovery_script=args.host_discovery_script,
        slots_per_host=_whole(args.slots_per_host, "--slots-per-host", 1),
        reset_limit=_whole(args.reset_limit, "--reset-limit", 0), cooldown=cooldown,
        elastic_timeout_s=_seconds(timeout_text, flag) if timeout_text else DEFAULT_ELASTIC_TIMEOUT_S,
    )
