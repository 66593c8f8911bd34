"""``polytrain.horovod.tensorflow.keras``: the same module as `polytrain.horovod.keras` (Horovod's layout)."""

from polytrain.horovod.keras import *  # noqa: F403
from polytrain.horovod.keras import __all__, callbacks, elastic, load_model  # noqa: F401
