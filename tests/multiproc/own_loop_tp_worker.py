"""A hand-written loop on `polytrain.torch.Distributed` with tensor parallel, as a script would have it.

Two models: ``transformer``, the zoo transformer LM (2 blocks, 4 heads, tied head; its plan is built in) on
next-token data, and ``user``, the residual MLP of tp_user_model.py, split by its own plan given as a
function (``parallel={"tensor": 2, "tensor_plan": plan}``), on random features classified by a random linear
map (no sklearn import: 4 ranks start faster). SGD with momentum, 2 micro-steps of accumulation,
clipping that bites, 2 epochs over a set whose last batch is short (6 updates). Loaders go through
``setup_dataloaders`` with a global batch of 8 (8 / data shards per loader); each micro-step's loss is the mean of
the per-sample losses `gather_for_metrics` returns. After training, an evaluation pass over an uneven set of 13
samples gathers each sample's id and logits. Rank 0 writes the losses, the gradient norms, the evaluation, the
final full weights (`get_state_dict`) and a random draw made after ``setup`` on every rank (the ranks of a tensor
group must draw alike: their dropout masks).

Usage: python own_loop_tp_worker.py MODELS BACKEND TENSOR OUT_DIR (MODELS: transformer, user, or both
comma-separated, each in a `Distributed` of its own, written to OUT_DIR/MODEL.json; TENSOR 1: no parallel table).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clean_exit_fit import native_threads  # noqa: E402
from tp_user_model import ResidualMLP, plan  # noqa: E402

from polytrain.torch import Distributed  # noqa: E402

GLOBAL_BATCH, ACCUM, EPOCHS, CLIP, SAMPLES, EVAL = 8, 2, 2, 0.3, 44, 13
VOCAB, LENGTH = 32, 8


def transformer_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from polytrain.adapters.torch.transformer import build_transformer
    from polytrain.data.source import DatasetInfo
    from polytrain.spec.zoo import TransformerParams

    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (SAMPLES + EVAL, 1), generator=gen)
    steps = torch.randint(1, 4, (SAMPLES + EVAL, 1), generator=gen)
    tokens = (starts + steps * torch.arange(LENGTH + 1)) % VOCAB  # arithmetic sequences: learnable
    params = TransformerParams(d_model=16, n_heads=4, n_layers=2, d_ff=32)
    model = build_transformer(params, DatasetInfo(input_shape=(LENGTH,), num_outputs=VOCAB, task="next_token"))
    return model, tokens[:, :-1], tokens[:, 1:]


def mlp_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES + EVAL, 64, generator=gen)
    teacher = torch.randn(64, 10, generator=gen)
    return ResidualMLP(64, 16, 2, 10), x, (x @ teacher).argmax(1)  # classes a linear map decides: learnable


def sample_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One loss per sample (a sequence's mean over its tokens)."""
    per = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return per.reshape(y.shape[0], -1).mean(1)


def run(which: str, backend: str, tensor: int, out: Path) -> None:
    parallel = None if tensor == 1 else {"tensor": tensor, **({"tensor_plan": plan} if which == "user" else {})}
    dist = Distributed(backend, grad_accum_steps=ACCUM, seed=5, parallel=parallel)
    torch.manual_seed(dist.rank)  # different weights on each rank before setup: setup gives every rank rank 0's
    model, x, y = transformer_data() if which == "transformer" else mlp_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = dist.setup(model, optimizer)
    draws = torch.zeros(dist.world_size, 3)
    draws[dist.rank] = torch.rand(3)  # every rank's first draw after setup
    draws = dist.all_reduce(draws, "sum").tolist()
    shards = dist.world_size // tensor
    train = dist.setup_dataloaders(DataLoader(TensorDataset(x[:SAMPLES], y[:SAMPLES]),
                                              batch_size=GLOBAL_BATCH // shards, shuffle=True))
    losses, norms = [], []
    for _ in range(EPOCHS):
        for xb, yb in train:
            with dist.accumulate(model):
                per = sample_losses(model(xb.to(dist.device)), yb.to(dist.device))
                dist.backward(per.mean())
            losses.append(float(dist.gather_for_metrics(per.detach()).mean()))
            norm = dist.clip_grad_norm_(model, CLIP)
            if norm is not None:
                norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
    ids, logits = [], []
    model.eval()
    with torch.no_grad():
        for idx, xb in dist.setup_dataloaders(DataLoader(TensorDataset(torch.arange(EVAL), x[SAMPLES:]),
                                                         batch_size=3)):
            got_ids, got_logits = dist.gather_for_metrics((idx, model(xb.to(dist.device))))
            ids += got_ids.tolist()
            logits += got_logits.reshape(len(got_ids), -1).tolist()
    state = dist.get_state_dict(model)
    dist.end()
    left = native_threads()  # none, with the split model still held here
    if dist.is_main:
        with open(out, "w") as f:
            json.dump({"backend": dist.backend_name, "world": dist.world_size, "losses": losses, "norms": norms,
                       "ids": ids, "logits": logits, "draws": draws, "threads_left": left,
                       "weights": {k: v.flatten().tolist() for k, v in state.items()}}, f)


def main() -> None:
    models, backend, tensor, out = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    for which in models:
        run(which, backend, tensor, out / f"{which}.json")


if __name__ == "__main__":
    main()
