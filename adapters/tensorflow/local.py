"""``local``: one TensorFlow process, no communication."""

from __future__ import annotations

from polytrain.adapters.tensorflow.backend import TFBackend


class LocalBackend(TFBackend):
    name = "local"
