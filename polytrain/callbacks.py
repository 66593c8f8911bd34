"""The callback API of a script or a spec's ``callbacks:``: subclass `Callback` (every hook does nothing) and read
`RunInfo`. The hooks' calls, early stopping and best checkpoints are `polytrain.train.callbacks`."""

from polytrain.train.callbacks import Callback, RunInfo

__all__ = ["Callback", "RunInfo"]
