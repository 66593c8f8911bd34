"""Resolving the user's own code named in a spec (``package.module:function``) with one-line errors."""

from __future__ import annotations

import importlib
from typing import Any

from polytrain.errors import SpecError

#: how a spec names a live object given to `polytrain.fit` (a model, loss or metric of the calling script)
LIVE_PREFIX = "fit:"


def is_import_path(name: str) -> bool:
    return ":" in name


def is_live(name: str) -> bool:
    return name.startswith(LIVE_PREFIX)


def load_callable(path: str, field_name: str) -> Any:
    """Import ``package.module:attribute`` and return it when callable; errors name ``field_name``."""
    if is_live(path):
        raise SpecError(f"{field_name}: {path!r} names a live object of a script; only polytrain.fit can supply it")
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise SpecError(f"{field_name}: {path!r} is not an import path of the form package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"{field_name}: cannot import module {module_name!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise SpecError(f"{field_name}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    target = getattr(module, attr, None)
    if not callable(target):
        raise SpecError(f"{field_name}: {module_name!r} has no callable {attr!r}")
    return target
