"""The ``HOROVOD_*`` tuning variables the shims honour, read with Horovod 0.28.1's defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from polytrain.horovod.common.errors import HorovodEnvError

MiB = 1024 * 1024
#: Horovod 0.28.1 ``operations.cc``: ``SetTensorFusionThresholdBytes(128 * 1024 * 1024)``.
DEFAULT_FUSION_THRESHOLD = 128 * MiB
#: Horovod 0.28.1 ``operations.cc``: ``SetCycleTimeMs(1)``.
DEFAULT_CYCLE_TIME_MS = 1.0
#: Horovod 0.28.1 ``stall_inspector.h``: warning after 60 s, no shutdown unless set.
DEFAULT_STALL_CHECK_SECONDS = 60.0

#: polytrain's own switch for the cross-rank metadata check of every collective (on by default).
METADATA_CHECK_VARIABLE = "POLYTRAIN_HOROVOD_METADATA_CHECK"


def _read_float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise HorovodEnvError(f"{name}={raw!r} is not a number; it must be a number >= {minimum:g}") from None
    if value < minimum:
        raise HorovodEnvError(f"{name}={raw!r} is below {minimum:g}; it must be a number >= {minimum:g}")
    return value


def _read_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on", "y"):
        return True
    if raw in ("0", "false", "no", "off", "n"):
        return False
    raise HorovodEnvError(f"{name}={env[name]!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


@dataclass(frozen=True)
class HorovodSettings:
    """The ``HOROVOD_*`` variables the shims honour, with Horovod 0.28.1's defaults."""

    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    cycle_time_ms: float = DEFAULT_CYCLE_TIME_MS
    stall_check: bool = True
    stall_check_seconds: float = DEFAULT_STALL_CHECK_SECONDS
    #: 0 means never shut down (Horovod's default); otherwise abort stalled ranks after this long.
    stall_shutdown_seconds: float = 0.0
    timeline: str | None = None
    metadata_check: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HorovodSettings:
        env = os.environ if env is None else env
        threshold = _read_float(env, "HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)
        if threshold != int(threshold):
            raise HorovodEnvError(f"HOROVOD_FUSION_THRESHOLD={env['HOROVOD_FUSION_THRESHOLD']!r} "
                                  "is not a whole number of bytes; it must be an integer >= 0")
        timeline = env.get("HOROVOD_TIMELINE", "").strip() or None
        return cls(
            fusion_threshold=int(threshold),
            cycle_time_ms=_read_float(env, "HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_TIME_MS),
            stall_check=not _read_bool(env, "HOROVOD_STALL_CHECK_DISABLE", False),
            stall_check_seconds=_read_float(env, "HOROVOD_STALL_CHECK_TIME_SECONDS",
                                            DEFAULT_STALL_CHECK_SECONDS),
            stall_shutdown_seconds=_read_float(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0),
            timeline=timeline,
            metadata_check=_read_bool(env, METADATA_CHECK_VARIABLE, True),
        )

    @property
    def shutdown_after(self) -> float | None:
        """Seconds after which a stalled collective aborts the job, or None (Horovod ignores a
        shutdown time shorter than the warning time)."""
        if self.stall_shutdown_seconds <= 0 or self.stall_shutdown_seconds < self.stall_check_seconds:
            return None
        return self.stall_shutdown_seconds
