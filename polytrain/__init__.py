"""polytrain: one training spec on PyTorch or TensorFlow, on any backend, under any launcher.

Importing this package imports no framework.
"""

from polytrain.world import World, detect_world

__version__ = "0.1.0"
__all__ = ["World", "detect_world", "__version__"]
