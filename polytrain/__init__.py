"""polytrain: one training spec on PyTorch or TensorFlow, on any backend, under any launcher.

Importing this package imports no framework. ``polytrain.fit(spec, model=..., train_data=...)`` trains
from a script (see `polytrain.api`).
"""

from typing import Any

from polytrain.environments import detect_world
from polytrain.version import __version__
from polytrain.world import World

__all__ = ["World", "detect_world", "fit", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "fit":  # imported on first use: the Trainer and its data layer are not needed to import polytrain
        from polytrain.api import fit

        return fit
    raise AttributeError(f"module 'polytrain' has no attribute {name!r}")
