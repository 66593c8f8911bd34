"""polytrain's implementation of the basics and raw collectives, on MPI (mpi4py) or in one process.

What ``polytrain.horovod.tensorflow`` runs without real Horovod (see ``_impl``): `basics`
starts the job, `ops` runs each collective as a TensorFlow op around `engine`. Each
module's ``__all__`` says which of its names belong to Horovod's API.
"""

from polytrain.horovod.tensorflow import basics, ops, process_sets
from polytrain.horovod.tensorflow.basics import *  # noqa: F403
from polytrain.horovod.tensorflow.ops import *  # noqa: F403
from polytrain.horovod.tensorflow.process_sets import *  # noqa: F403

IMPL = "polytrain"

__all__ = ["IMPL", *basics.__all__, *ops.__all__, *process_sets.__all__]
