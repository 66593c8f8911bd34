"""Child process of test_checkpointing_compile.py: one PyTorch backend in one process, reported as JSON.

``python execution_worker.py <backend>`` builds the zoo transformer through `TorchFramework` on that
backend three times (checkpointing off, on, and compile on) and prints what each build did: the
parameter names, which blocks are checkpointed, forward calls of a layer inside each block and of the
head during one micro-step, and which modules were compiled. A process of its own per backend: Horovod
and MPI initialise once per process, DeepSpeed keeps global state.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
from specs import lm

from polytrain import registry, validation
from polytrain.adapters.torch.execution import is_checkpointed
from polytrain.adapters.torch.framework import TorchFramework
from polytrain.data.source import DatasetInfo
from polytrain.spec import tables as spec_mod
from polytrain.world import World

LM = lm(tokens=None, d_model=16, n_heads=2, dropout=0.1)
INFO = DatasetInfo(input_shape=(8,), num_outputs=16, task="next_token")


def compiled(module: torch.nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def spec_for(backend: str, output: str, **fields: Any) -> spec_mod.TrainSpec:
    return validation.from_dict({**LM, "backend": backend, "output": output, **fields})


def build(back: Any, spec: spec_mod.TrainSpec) -> TorchFramework:
    fw = TorchFramework(spec, World(), back)
    fw.build(INFO)
    return fw


def one_step(fw: TorchFramework) -> dict[str, int]:
    plain = fw.backend.unwrap(fw.model)
    calls: dict[str, int] = {}
    handles = []
    for name, module in plain.named_modules():
        if name.endswith("mlp.fc") or name == "head":
            calls[name] = 0
            handles.append(module.register_forward_hook(
                lambda *_, name=name: calls.__setitem__(name, calls[name] + 1)))
    tokens = np.random.default_rng(0).integers(0, 16, size=(4, 9))
    fw.train_micro_step(tokens[:, :-1], tokens[:, 1:], 1.0, sync=True)
    fw.optimizer_step(0.1, clip_norm=None)
    for handle in handles:
        handle.remove()
    return calls


def main(backend: str, output: str) -> None:
    report: dict[str, Any] = {}
    # one backend set up once (Horovod initialises once per process); each build wraps a model of its own
    back = registry.create_backend(spec_for(backend, output), World())
    back.setup()
    try:
        for checkpointing in (False, True):
            fw = build(back, spec_for(backend, output, activation_checkpointing=checkpointing))
            plain = back.unwrap(fw.model)
            report[f"checkpointing={checkpointing}"] = {
                "names": [n for n, _ in plain.named_parameters()],
                "checkpointed": [is_checkpointed(b) for b in plain.blocks],
                "calls": one_step(fw)}
        fw = build(back, spec_for(backend, output, compile={"enabled": True}))  # placement: nothing runs yet
        plain = back.unwrap(fw.model)
        report["compiled"] = {"wrapper": fw.model is not plain and compiled(fw.model), "model": compiled(plain),
                              "blocks": [compiled(b) for b in plain.blocks], "state": sorted(fw.export_state())}
    finally:
        back.teardown()
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
