"""polytrain: one training spec on PyTorch or TensorFlow, on any backend, under any launcher.

Importing this package imports no framework.
"""

from polytrain.environments import detect_world
from polytrain.world import World

__version__ = "0.1.0"
__all__ = ["World", "detect_world", "__version__"]
