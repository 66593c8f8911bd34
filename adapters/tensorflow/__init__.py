"""The TensorFlow 2 / Keras 3 framework adapter and its backends (local, tf-multiworker, mpi)."""
