"""The Horovod-compatible API: ``polytrain.horovod.torch``, ``.tensorflow``, ``.keras``."""
