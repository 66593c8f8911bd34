"""Real Horovod or polytrain's shim: the one rule every framework package follows.

Each framework package (``torch``, ``tensorflow``) has a ``_real`` module (the real
``horovod.<framework>`` under polytrain's names) and a ``_shim`` module (polytrain's own
implementation); its ``_impl`` module imports the one `use_real_horovod` picks, once, and
everything else in the package reaches the implementation through it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from polytrain.errors import BackendUnavailableError, UserError
from polytrain.horovod.common.errors import HorovodEnvError, HorovodUnsupportedError

IMPL_VARIABLE = "POLYTRAIN_HOROVOD_IMPL"
IMPL_CHOICES = ("auto", "shim", "horovod")

#: Launchers under which the real Horovod can form its job: it reads only horovodrun's and MPI's
#: variables, so under torchrun & co. every process would silently become a job of size 1.
HOROVOD_CAPABLE_LAUNCHERS = frozenset({"horovodrun-gloo", "horovodrun-mpi", "openmpi", "mpich", "intelmpi",
                                       "mvapich", "lsf", "single"})


def implementation(env: Mapping[str, str] | None = None) -> str:
    """The value of ``POLYTRAIN_HOROVOD_IMPL``: ``auto`` (default), ``shim`` or ``horovod``."""
    env = os.environ if env is None else env
    value = env.get(IMPL_VARIABLE, "").strip().lower() or "auto"
    if value not in IMPL_CHOICES:
        raise HorovodEnvError(f"{IMPL_VARIABLE}={env[IMPL_VARIABLE]!r} is not allowed; use one of "
                              f"{', '.join(IMPL_CHOICES)}")
    return value


@cache
def _import_error(module: str) -> str | None:
    """None when ``module`` imports as an installed package; otherwise why not (one line).

    A directory named like it on ``sys.path`` (the test suite's ``tests/horovod``) imports as an
    empty namespace package when Horovod is not installed: that is not Horovod.
    """
    try:
        imported = importlib.import_module(module)
    except Exception as exc:  # a broken extension raises OSError/ImportError/RuntimeError alike
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    if getattr(imported, "__file__", None) is None:
        return f"ImportError: {module} is only a namespace package ({', '.join(imported.__path__)}), not Horovod"
    return None


def _launcher(env: Mapping[str, str] | None) -> str | None:
    from polytrain.environments import detect_world

    try:
        return detect_world(env).launcher
    except UserError:
        return None


def use_real_horovod(framework: str, env: Mapping[str, str] | None = None) -> bool:
    """True when scripts should get the real ``horovod.<framework>`` rather than polytrain's shim.

    ``framework`` is the module path below ``horovod`` (``torch``, ``tensorflow``,
    ``tensorflow.keras``, ``keras``). ``POLYTRAIN_HOROVOD_IMPL=shim`` never uses it and
    ``horovod`` requires it. ``auto`` (the default) uses it when it imports and the launcher
    is one it can run under (horovodrun, an MPI launcher, or a single process); under
    torchrun, the DeepSpeed launcher, Slurm's srun or polytrain's own launcher it uses the shim.
    """
    choice = implementation(env)
    if choice == "shim":
        return False
    if choice == "horovod":
        error = _import_error(f"horovod.{framework}")
        if error is not None:
            raise BackendUnavailableError(f"{IMPL_VARIABLE}=horovod but horovod.{framework} does not import "
                                          f"({error}); install Horovod (scripts/build_horovod.sh) or use auto/shim")
        return True
    launcher = _launcher(env)
    if launcher is not None and launcher not in HOROVOD_CAPABLE_LAUNCHERS:
        return False  # decided without importing Horovod (and its MPI library)
    return _import_error(f"horovod.{framework}") is None


def resolve_names(modules: Sequence[object], *names: str) -> tuple[Any, ...]:
    """Each of ``names`` from the first of ``modules`` that has it, in the order asked.

    By presence, not truth: ``Average`` is 0, a falsy value that is still the one to take. A name
    no module has becomes a function that raises `HorovodUnsupportedError` when called, so an
    older Horovod still imports and fails only where the script uses what it lacks.
    """
    return tuple(_resolve(modules, name) for name in names)


def _resolve(modules: Sequence[object], name: str) -> Any:
    for module in modules:
        if hasattr(module, name):
            return getattr(module, name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise HorovodUnsupportedError(f"this Horovod has no {name}; polytrain expects Horovod 0.28.1 "
                                      "(scripts/build_horovod.sh)")

    missing.__name__ = name
    return missing
