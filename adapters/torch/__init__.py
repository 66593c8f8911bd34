"""The PyTorch framework adapter and its backends (local, ddp, ...)."""
