"""Losses and metrics: the neutral rules (names, exact reduction) and both frameworks' numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polytrain.errors import SpecError
from polytrain.spec import objectives as objectives

torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")

from polytrain.adapters.tensorflow import objectives as tf_obj  # noqa: E402
from polytrain.adapters.torch import objectives as torch_obj  # noqa: E402

RNG = np.random.default_rng(0)
LOGITS = RNG.standard_normal((7, 6)).astype(np.float32)
LABELS = np.array([0, 5, 2, 2, 1, 3, 4], dtype=np.int64)
SEQ_LOGITS = RNG.standard_normal((3, 4, 9)).astype(np.float32)
SEQ_LABELS = RNG.integers(0, 9, size=(3, 4))
PRED = RNG.standard_normal((7, 1)).astype(np.float32)
TARGET = RNG.standard_normal(7).astype(np.float32)
BINARY = (RNG.random(7) > 0.5).astype(np.float32)


def reference(name: str, out: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each built-in, per sample, in numpy."""
    if name in ("cross_entropy", "next_token"):
        shifted = out - out.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        per = -np.take_along_axis(logp, y[..., None], -1)[..., 0]
        return per.mean(axis=1) if name == "next_token" else per
    diff = out.reshape(len(y), -1) - y.reshape(len(y), -1)
    if name == "mse":
        return (diff ** 2).mean(1)
    if name == "mae":
        return np.abs(diff).mean(1)
    z, t = out.reshape(len(y), -1), y.reshape(len(y), -1)  # bce with logits
    return (np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z)))).mean(1)


CASES = [("cross_entropy", LOGITS, LABELS), ("next_token", SEQ_LOGITS, SEQ_LABELS), ("mse", PRED, TARGET),
         ("bce", PRED, BINARY)]


@pytest.mark.parametrize(("name", "out", "y"), CASES)
def test_built_in_losses_give_one_value_per_sample_alike_in_both_frameworks(name: str, out: np.ndarray,
                                                                             y: np.ndarray) -> None:
    expected = reference(name, out, y)
    got_torch = torch_obj.LOSSES[name](torch.from_numpy(out), torch.from_numpy(y)).numpy()
    got_tf = tf_obj.LOSSES[name](tf.constant(out), tf.constant(y)).numpy()
    assert got_torch.shape == got_tf.shape == (len(y),)
    np.testing.assert_allclose(got_torch, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_tf, expected, rtol=1e-5, atol=1e-6)


def test_metrics_alike_in_both_frameworks() -> None:
    logits, labels = LOGITS.copy(), LABELS.copy()
    logits[0, 0] = 9.0  # sample 0 right at rank 1; the rest as drawn
    top5 = np.array([lab in np.argsort(-row)[:5] for row, lab in zip(logits, labels)], dtype=np.float32)
    expected = {"accuracy": (logits.argmax(1) == labels).astype(np.float32), "top5_accuracy": top5}
    for name, values in expected.items():
        got_torch = torch_obj.METRICS[name](torch.from_numpy(logits), torch.from_numpy(labels)).numpy()
        got_tf = tf_obj.METRICS[name](tf.constant(logits), tf.constant(labels)).numpy()
        np.testing.assert_array_equal(got_torch, values)
        np.testing.assert_array_equal(got_tf, values)
    assert 0 < expected["accuracy"].sum() < expected["top5_accuracy"].sum() < len(labels)
    for name in ("mse", "mae"):
        np.testing.assert_allclose(torch_obj.METRICS[name](torch.from_numpy(PRED), torch.from_numpy(TARGET)).numpy(),
                                   reference(name, PRED, TARGET), rtol=1e-6)
        np.testing.assert_allclose(tf_obj.METRICS[name](tf.constant(PRED), tf.constant(TARGET)).numpy(),
                                   reference(name, PRED, TARGET), rtol=1e-6)


def test_evaluation_sums_per_token_for_next_token_data_and_per_sample_otherwise() -> None:
    per_token = reference("cross_entropy", SEQ_LOGITS.reshape(-1, 9), SEQ_LABELS.reshape(-1))
    fns = torch_obj.metric_fns(("accuracy", "perplexity"))
    assert list(fns) == ["accuracy"]  # perplexity comes from the reduced loss
    totals = torch_obj.evaluation("next_token", torch_obj.LOSSES["next_token"], fns,
                                  torch.from_numpy(SEQ_LOGITS), torch.from_numpy(SEQ_LABELS))
    assert totals["loss"][1] == totals["accuracy"][1] == 12
    assert totals["loss"][0] == pytest.approx(per_token.sum(), rel=1e-5)
    tf_totals = tf_obj.evaluation("next_token", tf_obj.LOSSES["next_token"], tf_obj.metric_fns(("accuracy",)),
                                  tf.constant(SEQ_LOGITS), tf.constant(SEQ_LABELS))
    assert float(tf_totals["loss"][0]) == pytest.approx(totals["loss"][0], rel=1e-5)
    assert float(tf_totals["accuracy"][0]) == totals["accuracy"][0]


def test_reduce_divides_sums_by_counts_never_averages_of_averages() -> None:
    # two ranks: 3 samples with loss sum 3 and 1 sample with loss sum 5 -> 8 / 4, not (1 + 5) / 2
    totals = {"loss": (3.0 + 5.0, 3 + 1), "accuracy": (2.0 + 0.0, 3 + 1), "mod:errors": (0.0, 0.0)}
    loss, values = objectives.reduce(totals, ("accuracy", "perplexity", "mod:errors"))
    assert loss == 2.0 and values["accuracy"] == 0.5 and values["perplexity"] == pytest.approx(math.exp(2.0))
    assert math.isnan(values["errors"])  # a metric with no samples is NaN, not 0


def test_a_user_loss_must_give_one_value_per_sample() -> None:
    def mean_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, y)

    fn = torch_obj.loss_fn("fit:mean_loss", live=mean_loss)
    with pytest.raises(SpecError) as info:
        fn(torch.from_numpy(LOGITS), torch.from_numpy(LABELS))
    assert str(info.value) == ("loss: fit:mean_loss returned () for outputs of shape (7, 6) and targets of shape "
                               "(7,); it must return one value per sample, shape (7,) (not reduced to a mean or a "
                               "sum, nor broadcast across samples)")


def abs_error(out, y):  # noqa: ANN001, ANN201 - a user's function, for either framework
    return abs(out - y)


def test_a_single_output_head_reaches_user_functions_shaped_like_the_targets() -> None:
    """Issue 36 item 3: (B, 1) outputs against (B,) targets made ``abs(out - y)`` (B, B)."""
    expected = np.abs(PRED[:, 0] - TARGET)
    got_torch = torch_obj.loss_fn("fit:abs_error", live=abs_error)(torch.from_numpy(PRED), torch.from_numpy(TARGET))
    metric = tf_obj.metric_fns(("fit:abs_error",), live={"fit:abs_error": abs_error})["fit:abs_error"]
    traced = tf.function(metric, input_signature=[tf.TensorSpec([None, 1]), tf.TensorSpec([None])])
    np.testing.assert_allclose(got_torch.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(metric(tf.constant(PRED), tf.constant(TARGET)).numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(traced(tf.constant(PRED), tf.constant(TARGET)).numpy(), expected, rtol=1e-6)
    # several outputs per sample (class scores) come as they are
    seen = []
    torch_obj.loss_fn("fit:ce", live=lambda out, y: seen.append(tuple(out.shape)) or out[:, 0])(
        torch.from_numpy(LOGITS), torch.from_numpy(LABELS))
    assert seen == [(7, 6)]
    assert objectives.single_output((None, 1), (None,)) and not objectives.single_output((7, 1), (7, 1))


def test_a_user_function_that_broadcasts_is_one_line_naming_the_shapes() -> None:
    def outer(out, y):  # noqa: ANN001, ANN202 - (B,) against (B, 1): broadcast to (B, B)
        return abs(out - y[:, None])

    with pytest.raises(SpecError) as info:
        torch_obj.metric_fns(("fit:outer",), live={"fit:outer": outer})["fit:outer"](
            torch.from_numpy(PRED), torch.from_numpy(TARGET))
    assert str(info.value) == ("metrics[0]: fit:outer returned (7, 7) for outputs of shape (7,) and targets of shape "
                               "(7,); it must return one value per sample, shape (7,) (not reduced to a mean or a "
                               "sum, nor broadcast across samples)")
    loss = tf.function(tf_obj.loss_fn("fit:outer", live=outer),
                       input_signature=[tf.TensorSpec([None, 1]), tf.TensorSpec([None])])
    with pytest.raises(SpecError) as info:
        loss(tf.constant(PRED), tf.constant(TARGET))  # checked when traced: the batch size is not known yet
    assert str(info.value) == ("loss: fit:outer returned (batch, batch) for outputs of shape (batch,) and targets of "
                               "shape (batch,); it must return one value per sample, shape (batch,) (not reduced to "
                               "a mean or a sum, nor broadcast across samples)")


@pytest.mark.parametrize(("loss", "metrics", "message"), [
    ("hinge", None, "loss: 'hinge' is not a built-in loss (allowed: cross_entropy, mse, bce, next_token, or "
                    "package.module:function returning one loss per sample)"),
    (None, ["accuracy", "f1"], "metrics[1]: 'f1' is not a built-in metric (allowed: accuracy, top5_accuracy, mse, "
                               "mae, perplexity, or package.module:function returning one value per sample)"),
    (None, ["mae", "mae"], "metrics: each metric may appear once, got ['mae', 'mae']"),
    ("json:no_such", None, "loss: 'json' has no callable 'no_such'"),
    (None, ["no_module_x:f"], "metrics[0]: cannot import module 'no_module_x'"),
    ("fit:thing", None, None),  # a live name (polytrain.fit supplies it) passes the name check
])
def test_names_are_checked(loss: str | None, metrics: list[str] | None, message: str | None) -> None:
    if message is None:
        objectives.check_names(loss, metrics)
        return
    with pytest.raises(SpecError) as info:
        objectives.check_names(loss, metrics)
    assert str(info.value).startswith(message)
