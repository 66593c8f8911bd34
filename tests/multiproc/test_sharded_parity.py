"""Sharded backends train exactly like one process: DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 vs ``local``.

One spec (the zoo's transformer LM on token data, fp32, SGD with momentum and a cosine
learning-rate decay set every step, 2 micro-steps of accumulation, gradient clipping that
bites, 22 steps), the same global batch: 2 ranks
× 8 sequences × 2 micro-steps under torchrun vs 1 process × 16 × 2. Per-step losses must
agree within 1e-5 relative; final weights within 1e-5 of each tensor's largest value
(measured: ~1e-7 for losses, a few 1e-6 for weights, on every backend; printed with -s).
SGD rather than Adam: Adam divides by the gradient's own magnitude, so on parameters whose
exact gradient is zero (an attention key bias) it turns 1e-10 rounding noise into ±lr steps.

Each run's ``model.safetensors`` (FSDP: gathered shards; ZeRO: the consolidated fp32
master weights) must load into a plain single-process model that reproduces the run's
validation accuracy; each ZeRO run also writes DeepSpeed's own checkpoint, which
`polytrain.checkpoint.export` must turn into the same weights, bit for bit. The runs of one world size and
backend family (torch's own, DeepSpeed) go in turn in one launch (`procs.trained_runs`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from procs import trained_run, trained_runs
from specs import PARITY_TRAINING, as_sets, lm, merged

from polytrain.checkpoint.store import read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

LM = as_sets(merged(lm(), PARITY_TRAINING))
STEPS, TOLERANCE = 22, 1e-5

BACKENDS = {
    "ddp": ["backend=ddp"],
    "fsdp-full_shard": ["backend=fsdp", "fsdp.sharding=full_shard"],
    "fsdp-shard_grad_op": ["backend=fsdp", "fsdp.sharding=shard_grad_op"],
    "fsdp-hybrid+checkpointing+offload": ["backend=fsdp", "fsdp.sharding=hybrid_shard",
                                          "fsdp.activation_checkpointing=true", "fsdp.cpu_offload=true"],
    "zero1": ["backend=deepspeed", "deepspeed.stage=1", "deepspeed.save_checkpoint=true"],
    "zero2": ["backend=deepspeed", "deepspeed.stage=2", "deepspeed.save_checkpoint=true"],
    "zero3": ["backend=deepspeed", "deepspeed.stage=3", "deepspeed.save_checkpoint=true"],
}


def trained(out: Path, changes: list[str], nproc: int,
            resume: Path | None = None) -> tuple[np.ndarray, dict[str, np.ndarray], dict]:
    """The LM job with ``changes``, on one process or ``nproc`` ranks under torchrun: per-step losses, weights,
    manifest."""
    run = trained_run(out, [*LM, *changes], nproc=nproc, resume=resume, timeout=400)
    return run.losses, run.state, run.manifest


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[np.ndarray, dict[str, np.ndarray], dict]]:
    """The reference run on one process, and the same without clipping, in one launch."""
    local = ["backend=local", "data.batch_size=16"]
    runs = trained_runs(tmp_path_factory.mktemp("local"), 1, {"reference": (local, None),
                                                               "no-clipping": ([*local, "loop.grad_clip_norm=null"], None)}, LM)
    return {name: (run.losses, run.state, run.manifest) for name, run in runs.items()}


@pytest.fixture(scope="module")
def reference(one_process: dict) -> tuple[np.ndarray, dict[str, np.ndarray], dict]:
    return one_process["reference"]


class TwoRanks:
    """Each backend's 2-rank run, trained with its family's (torch's own, DeepSpeed) in one launch on first use."""

    def __init__(self, root: Path) -> None:
        self.root, self.runs = root, {}

    def __getitem__(self, name: str) -> tuple[np.ndarray, dict[str, np.ndarray], dict, Path]:
        if name not in self.runs:
            family = [n for n in BACKENDS if n.startswith("zero") == name.startswith("zero")]
            runs = trained_runs(self.root, 2, {n: ([*BACKENDS[n], "data.batch_size=8"], None) for n in family}, LM)
            for n, run in runs.items():
                assert not run.left_behind, run.left_behind
                self.runs[n] = (run.losses, run.state, run.manifest, self.root / n)
        return self.runs[name]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> TwoRanks:
    return TwoRanks(tmp_path_factory.mktemp("two-ranks"))


def weight_difference(state: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """The largest difference of any tensor, relative to that tensor's largest magnitude."""
    assert set(state) == set(ref)
    return max(float(np.max(np.abs(state[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref)


def plain_model_accuracy(state: dict[str, np.ndarray], manifest: dict) -> float:
    """Next-token accuracy of the exported weights in a plain, single-process LM on the validation split."""
    import torch

    from polytrain import validation
    from polytrain.adapters.torch.transformer import build_transformer
    from polytrain.data import load_dataset
    from polytrain.spec.zoo import model_params

    spec = validation.from_dict(manifest["spec"])
    data = load_dataset(spec.data, spec.seed)
    model = build_transformer(model_params(spec.model.name, spec.model.params), data.info)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(data.x_val)).argmax(-1).numpy()
    return float(np.mean(pred == data.y_val))


@pytest.mark.parametrize("name", BACKENDS)
def test_two_ranks_match_local(name: str, reference: tuple, two_ranks: TwoRanks, tmp_path: Path) -> None:
    ref_losses, ref_state, ref_manifest = reference
    losses, state, manifest, out = two_ranks[name]
    assert len(losses) == len(ref_losses) == STEPS
    assert manifest["backend"] == next(s.partition("=")[2] for s in BACKENDS[name] if s.startswith("backend="))
    assert len(set(manifest["rank_state_digests"])) == 1, "ranks exported different weights"
    loss_rel = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    weight_rel = weight_difference(state, ref_state)
    print(f"\n{name}: losses within {loss_rel:.1e} relative, weights within {weight_rel:.1e}")
    assert loss_rel < TOLERANCE and weight_rel < TOLERANCE
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learned something
    assert all(v.dtype == np.float32 for v in state.values())  # full precision, consolidated
    assert "head.weight" in state and np.array_equal(state["head.weight"], state["tok_emb.weight"])  # tied

    assert plain_model_accuracy(state, manifest) == pytest.approx(manifest["val_accuracy"], abs=2e-3)
    assert manifest["val_accuracy"] == pytest.approx(ref_manifest["val_accuracy"], abs=2e-3)

    if manifest["backend"] == "deepspeed":
        config = json.loads((out / "deepspeed_config.json").read_text())
        assert config["zero_optimization"]["stage"] == int(name[-1])
        assert (config["gradient_clipping"], config["gradient_accumulation_steps"]) == (0.5, 2)
        assert config["train_micro_batch_size_per_gpu"] == 8 and config["train_batch_size"] == 32
        from polytrain.checkpoint.export import export_deepspeed

        exported = export_deepspeed(out / "deepspeed_checkpoint", tmp_path / "exported", trust=True)
        native, _ = read_model(exported.parent)
        assert set(native) == set(state)
        for key in state:
            np.testing.assert_array_equal(native[key], state[key], err_msg=key)


def test_clipping_changes_the_run(one_process: dict) -> None:
    """Without clipping the same run differs: the parity above covers clipping, not just the loss."""
    ref_losses, ref_state, _ = one_process["reference"]
    losses, state, _ = one_process["no-clipping"]
    assert np.max(np.abs(losses - ref_losses) / ref_losses) > 1e-3
    assert weight_difference(state, ref_state) > 1e-2


def test_zero3_checkpoint_resumes_on_zero3_and_fsdp(tmp_path: Path) -> None:
    """Optimizer state (Adam: moments and step) leaves ZeRO's partitions and enters ZeRO's or FSDP's shards."""
    adam = ["optimizer.name=adam", "optimizer.lr=0.01", "optimizer.momentum=0.0", "schedule.decay=none",
            "loop.max_steps=null", "loop.grad_clip_norm=null", "data.batch_size=8"]
    zero3 = ["backend=deepspeed", "deepspeed.stage=3"]
    full_losses, full_state, _ = trained(tmp_path / "full", [*adam, *zero3, "checkpoint.every_n_epochs=1"], nproc=2)
    first_epoch = sorted((tmp_path / "full" / "checkpoints").glob("step-*"))[0]
    resumed = len(full_losses) // 2
    runs = trained_runs(tmp_path, 2, {"zero3": ([*adam, *zero3], first_epoch),
                                      "fsdp": ([*adam, "backend=fsdp"], first_epoch)}, LM)
    for name, run in runs.items():
        losses, state, manifest = run.losses, run.state, run.manifest
        assert len(losses) == len(full_losses) - resumed and manifest["global_step"] == len(full_losses)
        np.testing.assert_allclose(losses, full_losses[resumed:], rtol=TOLERANCE)
        if name == "zero3":
            for key in full_state:
                np.testing.assert_array_equal(state[key], full_state[key], err_msg=key)
