"""Load the launcher variable dumps in ``dumps/`` (KEY=VALUE lines, ``#`` comments)."""

from __future__ import annotations

from pathlib import Path

DUMPS = Path(__file__).resolve().parent / "dumps"


def load_dump(name: str, **changes: str | None) -> dict[str, str]:
    """The dump ``dumps/<name>.env`` as a dict; ``changes`` set variables (None removes one)."""
    env: dict[str, str] = {}
    for line in (DUMPS / f"{name}.env").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def all_dump_names() -> list[str]:
    return sorted(p.stem for p in DUMPS.glob("*.env"))
