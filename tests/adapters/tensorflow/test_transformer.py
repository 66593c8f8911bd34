"""The Keras transformer LM is PyTorch's twin: names, shapes, initial scheme, forward pass, loss, training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from polytrain import registry, validation  # noqa: E402
from polytrain.adapters.tensorflow.models import build_model, from_portable, to_portable  # noqa: E402
from polytrain.adapters.torch.transformer import build_transformer  # noqa: E402
from polytrain.checkpoint.store import read_model  # noqa: E402
from polytrain.data import epoch_plan, load_dataset  # noqa: E402
from polytrain.data.source import DatasetInfo  # noqa: E402
from polytrain.spec.zoo import TransformerParams  # noqa: E402
from polytrain.train.trainer import Trainer  # noqa: E402
from polytrain.world import World  # noqa: E402

INFO = DatasetInfo(input_shape=(8,), num_outputs=13, task="next_token")
PARAMS = [
    {"d_model": 16, "n_heads": 4, "n_layers": 2},  # tied head, d_ff = 4·d_model
    {"d_model": 24, "n_heads": 3, "n_layers": 1, "d_ff": 40, "tie_weights": False},
]
TOKENS = {"samples": 320, "seq_len": 12, "vocab": 10, "noise": 0.1}
BASE = {"model": {"name": "transformer", "params": {"d_model": 32, "n_heads": 4, "n_layers": 2}},
        "data": {"name": "tokens", "batch_size": 16, "tokens": TOKENS}, "precision": "fp32"}


def is_norm(name: str) -> bool:
    return ".ln" in name or name.startswith("ln_f.")


def torch_lm(params: dict, info: DatasetInfo = INFO) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_transformer(TransformerParams(**params), info)


def make(framework: str, **raw: object):
    spec = validation.from_dict({**BASE, **raw, "framework": framework})
    data = load_dataset(spec.data, spec.seed)
    backend = registry.create_backend(spec, World())
    backend.setup()
    fw = registry.create_framework(spec, World(), backend)
    fw.build(data.info)
    return fw, data


def pair(**raw: object):
    """A PyTorch and a TensorFlow adapter of one spec, TensorFlow starting from PyTorch's weights."""
    torch_fw, data = make("torch", **raw)
    tf_fw, _ = make("tensorflow", **raw)
    tf_fw.load_state(torch_fw.export_state())
    return torch_fw, tf_fw, data


def perturbed(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Weights far from the N(0, 0.02) start (LayerNorms included), so logits and gradients are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if is_norm(name) and name.endswith(".weight") else 0.3 * noise)
    return model


@pytest.mark.parametrize("params", PARAMS)
def test_names_shapes_and_order_are_pytorchs(params: dict) -> None:
    torch_state = torch_lm(params).state_dict()
    model, entries = build_model("transformer", params, INFO, seed=0, precision="fp32")
    mine = [(e.name, to_portable(e.variable.numpy(), e.layout).shape) for e in entries]
    assert mine == [(k, tuple(v.shape)) for k, v in torch_state.items()]
    tied = params.get("tie_weights", True)
    head = next(e for e in entries if e.name == "head.weight")
    assert (head.variable is model.tok_emb.embeddings) == tied
    # parameters (not state-dict keys) as PyTorch counts them: a tied head is no parameter of its own
    assert len(model.trainable_variables) == len(list(torch_lm(params).parameters()))


@pytest.mark.parametrize("params", PARAMS)
def test_initial_values_follow_pytorchs_init_weights(params: dict) -> None:
    _, entries = build_model("transformer", params, INFO, seed=0, precision="fp32")
    state = {e.name: to_portable(e.variable.numpy(), e.layout) for e in entries}
    for name, value in state.items():
        if is_norm(name):
            expected = 1.0 if name.endswith(".weight") else 0.0
            assert np.all(value == expected), name  # LayerNorm: scale 1, shift 0
        elif name.endswith(".bias"):
            assert not value.any(), name  # Linear biases: zeros
        else:  # Linear and Embedding weights: N(0, 0.02) (within 4 standard errors), not truncated
            n = value.size
            assert abs(value.mean()) < 4 * 0.02 / np.sqrt(n), name
            assert value.std() == pytest.approx(0.02, rel=4 / np.sqrt(2 * n)), name
            if n >= 500:
                assert np.abs(value).max() > 2.2 * 0.02, name  # tails beyond a truncated normal's 2σ
    again = build_model("transformer", params, INFO, seed=0, precision="fp32")[1]
    other = build_model("transformer", params, INFO, seed=1, precision="fp32")[1]
    assert all(np.array_equal(a.variable.numpy(), e.variable.numpy()) for a, e in zip(again, entries))
    assert not np.array_equal(other[0].variable.numpy(), entries[0].variable.numpy())
    weights = {id(e.variable): e.variable.numpy() for e in entries if e.name.endswith("weight") and not is_norm(e.name)}
    firsts = [v.ravel()[:8].tobytes() for v in weights.values()]
    assert len(set(firsts)) == len(firsts)  # each tensor draws from its own seed


@pytest.mark.parametrize("params", PARAMS)
def test_same_state_same_logits_as_pytorch(params: dict) -> None:
    reference = perturbed(torch_lm(params)).eval()
    model, entries = build_model("transformer", params, INFO, seed=0, precision="fp32")
    state = reference.state_dict()
    for e in entries:
        e.variable.assign(from_portable(state[e.name].numpy(), e.layout))
    tokens = np.random.default_rng(0).integers(0, INFO.num_outputs, (6, 8))
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens)).numpy()
    assert np.abs(expected).max() > 1.0  # a meaningful comparison, not of near-zero logits
    np.testing.assert_allclose(model(tokens).numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model(tokens[:, :5]).numpy(), expected[:, :5], rtol=1e-5, atol=1e-5)  # causal
    with pytest.raises(ValueError, match="sequence of 9 tokens is longer than the model's 8"):
        model(np.zeros((1, 9), np.int64))


@pytest.mark.parametrize("tie", [True, False])
def test_frameworks_agree_on_loss_gradients_and_evaluation(tie: bool) -> None:
    model = {"name": "transformer", "params": {"d_model": 32, "n_heads": 4, "n_layers": 2, "tie_weights": tie}}
    torch_fw, tf_fw, data = pair(model=model)
    torch_fw.load_state({k: v.detach().numpy() for k, v in perturbed(torch_lm(model["params"], data.info))
                         .state_dict().items()})
    tf_fw.load_state(torch_fw.export_state())
    assert set(tf_fw.export_state()) == set(torch_fw.export_state())
    assert tf_fw.parameter_shapes() == torch_fw.parameter_shapes()  # a tied head.weight is not counted twice
    x, y = data.x_train[:16], data.y_train[:16]
    assert x.dtype == y.dtype == np.int64 and y.shape == (16, 12)
    losses = [fw.train_micro_step(x, y, 1 / 16, sync=True) for fw in (torch_fw, tf_fw)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    with torch.no_grad():  # the loss's definition: per sample the mean over tokens, summed over samples
        logits = torch_fw.model(torch.from_numpy(x))
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(y).flatten(),
                                                      reduction="none")
    assert losses[0] == pytest.approx(float(per_token.view(16, 12).mean(1).sum()), rel=1e-6)
    grads = {n: p.grad.numpy() for n, p in torch_fw.model.named_parameters()}
    for entry, acc in zip(tf_fw._trainable_entries(), tf_fw.accumulators):
        np.testing.assert_allclose(to_portable(acc.numpy(), entry.layout), grads[entry.name], rtol=1e-4, atol=1e-6,
                                   err_msg=entry.name)
    evaluations = [fw.evaluate(data.x_val, data.y_val) for fw in (torch_fw, tf_fw)]
    assert evaluations[1]["loss"][1] == evaluations[0]["loss"][1] == data.y_val.size  # counted per token
    assert evaluations[1]["accuracy"][1] == evaluations[0]["accuracy"][1] == data.y_val.size
    assert evaluations[1]["loss"][0] == pytest.approx(evaluations[0]["loss"][0], rel=1e-5)
    assert evaluations[1]["accuracy"][0] == evaluations[0]["accuracy"][0]
    assert tf_fw.evaluate(x[:0], y[:0]) == {"loss": (0.0, 0.0), "accuracy": (0.0, 0.0)}
    assert tf_fw.train_micro_step(x[:0], y[:0], 1 / 16, sync=True) == 0.0  # an empty micro-batch adds nothing


def test_dropout_is_for_training_only_and_follows_the_rng_state() -> None:
    model = {"name": "transformer", "params": {"d_model": 32, "n_heads": 4, "n_layers": 2, "dropout": 0.3}}
    torch_fw, tf_fw, data = pair(model=model)
    x, y = data.x_train[:16], data.y_train[:16]
    start = tf_fw.rng_state()
    losses = []
    for _ in range(2):
        losses.append(tf_fw.train_micro_step(x, y, 1 / 16, sync=True))
        tf_fw.discard_gradients()
    tf_fw.set_rng_state(start)
    again = tf_fw.train_micro_step(x, y, 1 / 16, sync=True)
    assert losses[0] != losses[1] and again == losses[0]  # fresh masks each step, reproducible from a checkpoint
    evaluations = [fw.evaluate(x, y) for fw in (tf_fw, tf_fw, torch_fw)]  # no dropout when evaluating
    assert evaluations[0] == evaluations[1]
    assert evaluations[0]["loss"][0] == pytest.approx(evaluations[2]["loss"][0], rel=1e-5)


def test_bf16_computes_in_bfloat16_close_to_fp32() -> None:
    params = PARAMS[0]
    state = perturbed(torch_lm(params)).state_dict()
    tokens = np.random.default_rng(0).integers(0, INFO.num_outputs, (4, 8))
    logits = {}
    for precision in ("fp32", "bf16"):
        model, entries = build_model("transformer", params, INFO, seed=0, precision=precision)
        assert {e.variable.dtype for e in entries} == {"float32"}
        for e in entries:
            e.variable.assign(from_portable(state[e.name].numpy(), e.layout))
        logits[precision] = model(tokens)
    assert logits["bf16"].dtype == tf.bfloat16
    bf16 = tf.cast(logits["bf16"], tf.float32).numpy()
    assert not np.array_equal(bf16, logits["fp32"].numpy())
    scale = np.abs(logits["fp32"].numpy()).max()
    np.testing.assert_allclose(bf16, logits["fp32"].numpy(), atol=0.1 * scale)


def train_curve(fw, data, steps: int, lr: float, clip: float | None, accum: int = 1) -> list[float]:
    """The Trainer's step for ``steps`` steps on one process: mean training loss per sample, per step."""
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        for plan in epoch_plan(len(data.x_train), seed=0, epoch=epoch, global_batch=16 * accum, world_size=1,
                               rank=0, accum=accum):
            if len(losses) == steps:
                break
            last = len(plan.micro_batches) - 1
            total = sum(fw.train_micro_step(data.x_train[idx], data.y_train[idx], 1 / plan.global_count,
                                            sync=m == last) for m, idx in enumerate(plan.micro_batches))
            fw.optimizer_step(lr, clip)
            losses.append(total / plan.global_count)
        epoch += 1
    return losses


@pytest.mark.parametrize(("optimizer", "clip", "accum", "tie"), [
    ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, None, 1, True),
    ({"name": "adam", "lr": 0.003, "weight_decay": 0.001}, 0.5, 2, False),
])
def test_per_step_training_loss_matches_pytorch(optimizer: dict, clip: float | None, accum: int, tie: bool) -> None:
    model = {"name": "transformer", "params": {"d_model": 32, "n_heads": 4, "n_layers": 2, "tie_weights": tie}}
    torch_fw, tf_fw, data = pair(model=model, optimizer=optimizer, loop={"grad_accum_steps": accum})
    curves = [train_curve(fw, data, 25, optimizer["lr"], clip, accum) for fw in (torch_fw, tf_fw)]
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-4)
    assert curves[0][-1] < 0.85 * curves[0][0]  # it learned something in 25 steps
    mine, theirs = tf_fw.export_state(), torch_fw.export_state()
    for name in theirs:
        a, b = mine[name], theirs[name]
        if name.endswith("attn.qkv.bias"):  # the key bias's true gradient is 0 (softmax ignores a per-query
            d = len(a) // 3  # shift): Adam normalises the two frameworks' different rounding noise to ±lr
            a, b = np.delete(a, np.s_[d:2 * d]), np.delete(b, np.s_[d:2 * d])
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5, err_msg=name)
    exported, torch_opt = tf_fw.export_optimizer_state(), torch_fw.export_optimizer_state()
    assert set(exported) == set(torch_opt)  # optimizer state under PyTorch's parameter names (tok_emb, not head)


def test_tensorflow_learns_the_token_rule_like_pytorch(tmp_path: Path) -> None:
    """Each framework from its own initial weights, through the Trainer; then the saved TF model runs in PyTorch."""
    raw = {**BASE, "data": {"name": "tokens", "batch_size": 32, "tokens": {**TOKENS, "samples": 640}},
           "optimizer": {"name": "adam", "lr": 0.01},
           "schedule": {"lr_scaling": "none", "warmup_epochs": 0, "decay": "cosine"}, "loop": {"epochs": 12}}
    results = {}
    for framework in ("torch", "tensorflow"):
        spec = validation.from_dict({**raw, "framework": framework, "output": str(tmp_path / framework)})
        results[framework] = Trainer(spec, World(), show_progress=False).fit()
    tf_result, torch_result = results["tensorflow"], results["torch"]
    # chance is 1/10; both reach 0.77 in these 12 epochs (the rule allows ~0.9 after the first two positions)
    assert tf_result.val_accuracy > 0.7, tf_result
    assert tf_result.val_accuracy == pytest.approx(torch_result.val_accuracy, abs=0.05)
    assert tf_result.val_loss < 0.5 * np.log(10)  # per-token cross-entropy, from ~log(vocab) at the start

    state, manifest = read_model(tmp_path / "tensorflow")  # tied: tok_emb.weight and head.weight, equal
    np.testing.assert_array_equal(state["head.weight"], state["tok_emb.weight"])
    torch_fw, data = make("torch", **{k: v for k, v in raw.items() if k != "framework"})
    torch_fw.load_state(state)
    (loss, count), (correct, _) = torch_fw.evaluate(data.x_val, data.y_val).values()
    assert correct / count == pytest.approx(manifest["val_accuracy"], abs=1e-9)
    assert loss / count == pytest.approx(manifest["val_loss"], rel=1e-5)
