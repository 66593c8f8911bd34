"""One process of tests/adapters/torch/test_deepspeed_inputs.py: a bf16 DeepSpeed engine's training micro-step and
evaluation on fp32 inputs, with no autocast around them (as on a GPU, where the engine turns CUDA autocast off
inside its forward), the inputs given as the Trainer gives them (through the precision component's
``convert_input``). Prints the weights' dtype, the loss and the outputs' dtype as JSON.

Usage: python deepspeed_inputs_worker.py PRECISION OUTPUT_DIR
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch

from polytrain import registry, validation
from polytrain.adapters.torch.precision import Precision
from polytrain.environments import detect_world


def main() -> None:
    spec = validation.from_dict({"backend": "deepspeed", "precision": sys.argv[1], "output": sys.argv[2], "seed": 0})
    backend = registry.create_backend(spec, detect_world())
    backend.setup()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        precision = Precision(spec, backend)
        wrapped, _ = backend.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = precision.convert_input(torch.randn(8, 4)), torch.randint(0, 3, (8,))

        def loss_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out.float(), target, reduction="sum")

        loss = backend.train_micro_step(wrapped, x, y, loss_sum, 1.0 / 8, True, contextlib.nullcontext(),
                                        precision.scaler)
        out = backend.eval_outputs(backend.unwrap(wrapped), x, contextlib.nullcontext())
        weights = next(backend.unwrap(wrapped).parameters()).dtype
        print(json.dumps({"weights": str(weights), "loss": float(loss), "out": str(out.dtype)}))
    finally:
        backend.teardown()


if __name__ == "__main__":
    main()
