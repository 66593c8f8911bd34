"""TensorFlow imported without its C++ start-up notices, in a worker whose user did not ask for TF's logs.

Importing TensorFlow 2.x prints, in every process, absl's banner (``WARNING: All log messages before
absl::InitializeLog() is called are written to STDERR``), the oneDNN notice (``I... port.cc:...] oneDNN
custom operations are on ...``, once per TensorFlow library) and the CPU feature guard (``I...
cpu_feature_guard.cc:...] This TensorFlow binary is optimized ...`` and its ``To enable the following
instructions`` line): with N ranks, N copies of each in the launcher's output. ``TF_CPP_MIN_LOG_LEVEL``
does not reach the first two (absl writes them before TensorFlow configures its logging), and
``TF_ENABLE_ONEDNN_OPTS=0``, which would silence the notice, changes the kernels; so stderr is captured
while TensorFlow is imported, and everything but those notices (INFO lines and the banner) is written back.
``TF_CPP_MIN_LOG_LEVEL=1`` (INFO off, warnings and errors kept) covers the rest of the run.

A user who sets ``TF_CPP_MIN_LOG_LEVEL`` (any value, also with ``polytrain launch -x``) gets all of it.

Keras imports scikit-learn (for its estimator wrappers), matplotlib (its plotting helpers) and pandas (to
recognise a DataFrame passed to ``fit``) where they are installed: ~3 s of a rank's ~9 s of CPU to import
TensorFlow and Keras, for parts the Trainer never uses (it feeds Keras tensors). While a Trainer's rank imports
them, those three are not offered to Keras (`keras_extras_left_out`); polytrain and the user's code import them
as usual afterwards. One that is imported already (a script that imports it before polytrain) is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
QUIET_LEVEL = "1"  # INFO off: warnings and errors still show
_NOTICE = re.compile(rb"^(I\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w.]+:\d+\] "  # absl's INFO lines
                     rb"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                     rb"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler)")


def is_notice(line: bytes) -> bool:
    """Whether ``line`` is one of TensorFlow's start-up notices (see the module doc)."""
    return bool(_NOTICE.match(line))


KERAS_EXTRAS = ("sklearn", "matplotlib", "pandas")


class _LeaveOut:
    """A finder that says the named top-level packages are not installed."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in self.names:
            raise ImportError(f"{name} is left out while polytrain imports Keras", name=name)


@contextlib.contextmanager
def keras_extras_left_out() -> Iterator[None]:
    """Keras's optional scikit-learn, matplotlib and pandas parts left out of the import (see the module doc)."""
    finder = _LeaveOut(tuple(name for name in KERAS_EXTRAS if name not in sys.modules))
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def _import_keras_and_tensorflow() -> bool:
    """Keras and TensorFlow imported without Keras's extras; False where they are not installed."""
    with keras_extras_left_out():
        try:
            import keras  # noqa: F401
            import tensorflow  # noqa: F401
        except ImportError:
            return False
    return True


def import_tensorflow_quietly(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Import TensorFlow (and Keras) with the start-up notices left out, unless the user set the log level
    or TensorFlow is imported already; returns whether it did. Without TensorFlow it does nothing (the
    backend says what to install)."""
    if "tensorflow" in sys.modules:
        return False
    if LEVEL_VARIABLE in environ:
        _import_keras_and_tensorflow()
        return False
    environ[LEVEL_VARIABLE] = QUIET_LEVEL
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as capture:
            os.dup2(capture.fileno(), 2)
            try:
                if not _import_keras_and_tensorflow():
                    return False
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                capture.seek(0)
                kept = b"".join(line for line in capture if not is_notice(line))
                if kept:
                    os.write(2, kept)
    finally:
        os.close(saved)
    return True
