"""Keep your own TensorFlow / Keras 3 training loop: `Distributed` puts a ``tf.GradientTape`` loop or a
``model.fit`` on any of polytrain's TensorFlow backends (local, mpi, horovod, tf-multiworker) under any launcher,
through the same backend objects the Trainer uses. See `polytrain.tensorflow.distributed`."""

from polytrain.errors import OwnLoopError
from polytrain.tensorflow.averaging import DistributedOptimizer
from polytrain.tensorflow.distributed import Distributed

__all__ = ["Distributed", "DistributedOptimizer", "OwnLoopError"]
