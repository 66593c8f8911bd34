"""The benches' transformer job: the zoo's LM on polytrain's own framework adapter and a backend, built
from a spec, fed random token batches, one optimizer step at a time.

Imported by the bench scripts from their own directory (``python bench/X.py`` and torchrun put it first
on ``sys.path``): ``from lm_job import open_lm_job``.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Any

LM = {"d_model": 256, "n_heads": 8, "n_layers": 4}
VOCAB, SEQ, BATCH = 1024, 64, 8


@dataclass
class LmJob:
    world: Any  # polytrain.world.World
    backend: Any  # polytrain.protocols.Backend, set up
    fw: Any  # polytrain.protocols.Framework, built
    rng: Any  # numpy Generator, seeded by rank
    vocab: int
    seq: int
    batch: int

    def tokens(self) -> tuple[Any, Any]:
        """One random batch: inputs and next-token targets, ``batch`` × ``seq``."""
        shape = (self.batch, self.seq)
        return self.rng.integers(0, self.vocab, shape), self.rng.integers(0, self.vocab, shape)

    def step(self, x: Any = None, y: Any = None) -> float:
        """One training step (forward, backward, the backend's reduction, Adam) after a barrier; its seconds.
        The loss scale is the Trainer's (world size / samples in the step)."""
        if x is None:
            x, y = self.tokens()
        self.backend.barrier()
        start = time.perf_counter()
        self.fw.train_micro_step(x, y, 1.0 / self.batch, sync=True)
        self.fw.optimizer_step(1e-3, None)
        return time.perf_counter() - start


def open_lm_job(overrides: dict[str, Any], *, prefix: str, world: Any = None, lm: dict[str, int] | None = None,
                vocab: int = VOCAB, seq: int = SEQ, batch: int = BATCH) -> LmJob:
    """Set up the backend and build the model of a spec: ``overrides`` (backend, its table, compile, ...) over
    the LM, Adam and token data; the output goes to a fresh temporary directory named with ``prefix``."""
    import numpy as np

    from polytrain import registry, validation
    from polytrain.data.source import DatasetInfo
    from polytrain.environments import detect_world

    world = world if world is not None else detect_world()
    raw = {"output": tempfile.mkdtemp(prefix=prefix), "model": {"name": "transformer", "params": lm or LM},
           "optimizer": {"name": "adam", "lr": 1e-3},
           "data": {"name": "tokens", "batch_size": batch, "tokens": {"vocab": vocab, "seq_len": seq}}, **overrides}
    spec = validation.from_dict(raw)
    backend = registry.create_backend(spec, world)
    backend.setup()
    fw = registry.create_framework(spec, world, backend)
    fw.build(DatasetInfo(input_shape=(seq,), num_outputs=vocab, task="next_token"))
    return LmJob(world, backend, fw, np.random.default_rng(world.rank), vocab, seq, batch)
