"""The user's own code: resolving what a spec names (``package.module:function``) with one-line errors, and
calling it so that an exception it raises is reported by hook and by the user's own frames (`call_user`)."""

from __future__ import annotations

import importlib
import importlib.util
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from polytrain.errors import SpecError, TrainingFailure, UserError, is_peer_failure

T = TypeVar("T")

#: how a spec names a live object given to `polytrain.fit` (a model, loss or metric of the calling script)
LIVE_PREFIX = "fit:"

_SKIP_IMPORTS: ContextVar[bool] = ContextVar("polytrain_skip_imports", default=False)


@contextmanager
def imports_skipped() -> Iterator[None]:
    """Within it `load_callable` checks only the form of an import path, imports nothing and returns None:
    for checking a spec in a process that may not see the user's modules (``polytrain launch``, whose workers
    may get a PYTHONPATH with ``-x`` that it has not). Code run within it only validates; it uses no result."""
    token = _SKIP_IMPORTS.set(True)
    try:
        yield
    finally:
        _SKIP_IMPORTS.reset(token)


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
    if _SKIP_IMPORTS.get():
        return None
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


class UserCodeError(TrainingFailure):
    """An exception raised inside the user's own code while polytrain ran it, exit code 1 (the spec was valid; the
    run failed in code polytrain only called). ``hook`` says where it ran (``loss``, ``metric``, ``data.transform``,
    ``callback on_step_end``, ...), ``name`` what the user called it (the spec's import path, or ``fit:<name>``),
    ``frames`` the user's frames of its traceback (`user_frames`); the original exception is its ``__cause__``."""

    def __init__(self, hook: str, name: str, error: BaseException, frames: traceback.StackSummary) -> None:
        text = str(error).strip().splitlines()
        detail = f"{type(error).__name__}: {text[0]}{' ...' if len(text) > 1 else ''}" if text else type(error).__name__
        super().__init__(f"error in {hook} {name!r} (user code): {detail}")
        self.hook, self.name, self.frames = hook, name, frames

    def report(self, prefix: str = "polytrain: ") -> str:
        """The user's frames as Python prints them, then the one line (``prefix`` may name the rank)."""
        head = "Traceback (the user's frames; polytrain's and libraries' are left out, --debug shows them):\n"
        frames = head + "".join(self.frames.format()) if self.frames else ""
        return f"{frames}{prefix}{self}"


def call_user(hook: str, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; an exception it raises becomes a `UserCodeError` naming ``hook`` and ``name``.
    polytrain's own errors (a nested hook's, or a one-line check) and a collective's lost peer pass through."""
    try:
        return fn(*args, **kwargs)
    except (UserError, TrainingFailure):
        raise
    except Exception as exc:  # noqa: BLE001 - anything the user's code raises
        if is_peer_failure(exc):  # a collective it ran lost a peer: the job's failure, named by the Trainer
            raise
        raise UserCodeError(hook, name, exc, user_frames(exc.__traceback__, fn)) from exc


def user_name(obj: Any) -> str:
    """``module:qualified name`` of a function or class (of an instance's class otherwise)."""
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}:{target.__qualname__}"


def user_frames(tb: TracebackType | None, fn: Any = None) -> traceback.StackSummary:
    """The frames of ``tb`` in the user's code: those outside polytrain, the standard library and installed
    packages — and any in the file that defines ``fn`` (a user's module may be an installed package). Code
    TensorFlow's autograph generated from the user's (a loss traced in a ``tf.function``) is not theirs to read."""
    own = getattr(getattr(fn, "__code__", None), "co_filename", None)
    kept = [frame for frame in traceback.extract_tb(tb) if frame.filename == own or not (
        frame.filename.startswith(_library_dirs()) or "__autograph_generated_file" in frame.filename)]
    return traceback.StackSummary.from_list(kept)


@cache
def _library_dirs() -> tuple[str, ...]:
    """Path prefixes of polytrain's own modules and of the interpreter's libraries (as given and resolved)."""
    found = [Path(__file__).resolve().parents[1]]  # the polytrain package (this module is in polytrain/spec)
    for package in ("polytrain.adapters", "polytrain.launchers"):
        spec = importlib.util.find_spec(package)
        found += [Path(d) for d in (spec.submodule_search_locations or [])] if spec is not None else []
    paths = sysconfig.get_paths()
    found += [Path(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    dirs = {str(d) for d in found} | {str(d.resolve()) for d in found}
    return (*sorted(f"{d}/" for d in dirs), "<frozen ")
