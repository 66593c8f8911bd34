"""PyTorch versions of the zoo models.

Parameter names and shapes are the portable layout (see docs/portable-state.md):
``hidden.{i}.weight`` is (out, in) like ``nn.Linear``; convolution kernels are
(out, in, kh, kw). The TensorFlow adapter builds the same names and converts layouts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polytrain.data.source import DatasetInfo
from polytrain.errors import SpecError
from polytrain.spec.user_code import call_user
from polytrain.spec.zoo import ConvNetParams, MLPParams, is_import_path, load_factory, model_params

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Module):
    def __init__(self, in_features: int, num_outputs: int, params: MLPParams) -> None:
        super().__init__()
        sizes = (in_features, *params.hidden_sizes)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.act = ACTIVATIONS[params.activation]()
        self.head = nn.Linear(sizes[-1], num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = self.act(layer(x))
        return self.head(x)


class ConvNet(nn.Module):
    """Same-padded convolutions, a 2×2 max-pool after the last one, then a linear head."""

    def __init__(self, image_shape: tuple[int, int, int], num_outputs: int, params: ConvNetParams) -> None:
        super().__init__()
        channels, height, width = image_shape
        chans = (channels, *params.channels)
        k = params.kernel_size
        self.image_shape = image_shape
        self.conv = nn.ModuleList(nn.Conv2d(a, b, k, padding=k // 2) for a, b in zip(chans[:-1], chans[1:]))
        self.act = ACTIVATIONS[params.activation]()
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(chans[-1] * (height // 2) * (width // 2), num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)
        for layer in self.conv:
            x = self.act(layer(x))
        return self.head(self.pool(x).flatten(1))


def build_model(name: str, params: Any, info: DatasetInfo) -> nn.Module:
    """Build a zoo model, or call a user's ``package.module:factory(info, **params)``."""
    if is_import_path(name):
        model = call_user("model.name", name, load_factory(name), info, **dict(params))
        if not isinstance(model, nn.Module):
            raise SpecError(f"model.name: {name} returned {type(model).__name__}, not a torch.nn.Module")
        return model
    validated = model_params(name, params)
    if name == "mlp":
        in_features = 1
        for d in info.input_shape:
            in_features *= d
        return MLP(in_features, info.num_outputs, validated)
    if info.image_shape is None:
        raise SpecError(f"model.name: 'convnet' needs image data (digits, or an .npz with x of shape N×C×H×W); "
                        f"got samples of shape {info.input_shape}")
    return ConvNet(info.image_shape, info.num_outputs, validated)
