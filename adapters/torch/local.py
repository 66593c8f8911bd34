"""``local``: one process, no communication."""

from __future__ import annotations

from polytrain.adapters.torch.backend import TorchBackend


class LocalBackend(TorchBackend):
    name = "local"
