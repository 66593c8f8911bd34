"""`polytrain.tensorflow.Distributed` in one process: the dataset shards of two ranks make up each global batch in
one order whatever each rank's global seed, checkpoints round-trip and are the Trainer's (both ways), and misuse is
one clear error (multi-process parity: tests/multiproc/test_own_loop_tf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from polytrain.errors import OwnLoopError, UserError

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from polytrain.tensorflow import Distributed  # noqa: E402
from polytrain.tensorflow.data import shard  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def sequential(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def ids(dataset: tf.data.Dataset) -> list[list[int]]:
    return [[int(i) for i in batch] for batch in dataset]


def test_two_ranks_shards_make_up_each_global_batch_in_one_order_whatever_the_global_seed() -> None:
    """Each rank sets its own global seed (as a script does for per-rank dropout): the shuffle is the job's seed's
    alone, so rank 0's and rank 1's rows of every step are that step's global batch of one process."""
    samples = tf.data.Dataset.range(20)
    tf.random.set_seed(5)
    one = shard(samples, 0, 1, 8, seed=3, shuffle_buffer=20)
    parts = []
    for rank in (0, 1):
        tf.random.set_seed(11 + rank)
        parts.append(shard(samples, rank, 2, 8, seed=3, shuffle_buffer=20))
    for _ in range(2):  # two passes: a new order each, the same on every rank
        whole, first, second = ids(one), ids(parts[0]), ids(parts[1])
        assert [len(b) for b in whole] == [8, 8, 4] and [len(b) for b in first] == [4, 4, 2]
        assert [sorted(a + b) for a, b in zip(first, second)] == [sorted(b) for b in whole]
        assert [b[0::2] for b in whole] == first and [b[1::2] for b in whole] == second
    assert ids(one) != ids(one)  # reshuffled at each pass
    assert sorted(i for b in ids(one) for i in b) == list(range(20))
    assert ids(shard(samples, 0, 1, 8, seed=4, shuffle_buffer=20)) != ids(shard(samples, 0, 1, 8, seed=3,
                                                                                  shuffle_buffer=20))


def test_sharding_misuse_is_one_line() -> None:
    samples = tf.data.Dataset.range(9)
    with pytest.raises(OwnLoopError, match=r"^shard_dataset: global_batch_size 6 does not split evenly over 4 "
                                           r"ranks; give a multiple of 4$"):
        shard(samples, 0, 4, 6, seed=0)
    with pytest.raises(OwnLoopError, match=r"^shard_dataset: the last global batch would hold 1 sample\(s\) of 9, "
                                           r"fewer than the 2 ranks"):
        shard(samples, 0, 2, 4, seed=0)
    assert ids(shard(samples, 1, 2, 4, seed=0, drop_remainder=True)) == [[1, 3], [5, 7]]
    with pytest.raises(OwnLoopError, match=r"^shard_dataset: expected a tf.data.Dataset of single samples, got list"):
        shard([1, 2], 0, 1, 1, seed=0)


def test_one_process_steps_as_plain_keras_and_the_optimizer_is_the_wrapped_ones() -> None:
    """On one process the set-up optimizer applies the tape's own gradients: fit through it equals a plain fit."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype(np.float32), rng.integers(0, 3, 32)
    plain = sequential()
    plain.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS)
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    with Distributed("local") as dist:
        model, optimizer = dist.setup(sequential(), keras.optimizers.SGD(0.1, momentum=0.9))
        model.compile(optimizer=optimizer, loss=LOSS)
        model.fit(dist.shard_dataset(tf.data.Dataset.from_tensor_slices((x, y)), 8), epochs=2, verbose=0)
        assert int(optimizer.iterations) == 8 and float(optimizer.learning_rate) == pytest.approx(0.1)
        assert optimizer.variables is optimizer.inner_optimizer.variables or \
            optimizer.variables == optimizer.inner_optimizer.variables
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        grads = dist.gradient(tape, loss, model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        for mine, theirs in zip(grads, tape.gradient(loss, model.trainable_variables)):
            np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
        assert float(dist.all_reduce(3.5, "max")) == 3.5
        assert dist.all_reduce(tf.constant([3, 4]), "mean").numpy().tolist() == [3, 4]
    for a, b in zip(model.variables, plain.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    with Distributed("local") as dist:
        model, optimizer = dist.setup(sequential(), keras.optimizers.Adam(0.01))
        model.compile(optimizer=optimizer, loss=LOSS)
        rng = np.random.default_rng(1)
        model.fit(rng.normal(size=(16, 6)).astype(np.float32), rng.integers(0, 3, 16), batch_size=8, verbose=0)
        counter, table = tf.Variable([1.0, 2.0]), np.arange(4.0)
        saved = dist.save(tmp_path, {"model": model, "optimizer": optimizer, "step": 2, "epoch": 1, "counter": counter,
                                     "table": table, "note": {"lr": 0.01}}, keep_last=1)
        dist.save(tmp_path, {"model": model, "step": 3})
        assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
        weights = [v.numpy().copy() for v in model.variables]
        slots = [v.numpy().copy() for v in optimizer.variables]
        for v in [*model.variables, *optimizer.variables, counter]:
            v.assign(tf.zeros_like(v))
        table[:] = 0
        values = dist.load(saved, {"model": model, "optimizer": optimizer, "counter": counter, "table": table})
    assert values == {"note": {"lr": 0.01}, "step": 2, "epoch": 1, "step_in_epoch": 0}
    for before, v in zip([*weights, *slots], [*model.variables, *optimizer.variables]):
        np.testing.assert_array_equal(v.numpy(), before)
    assert int(optimizer.iterations) == 2
    assert counter.numpy().tolist() == [1.0, 2.0] and table.tolist() == [0.0, 1.0, 2.0, 3.0]
    manifest = json.loads((saved / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("format_version", "framework", "backend", "world_size", "global_step", "epoch",
                                     "origin")} == {"format_version": 1, "framework": "tensorflow", "backend": "local",
                                                    "world_size": 1, "global_step": 2, "epoch": 1, "origin": "own-loop"}
    assert set(manifest["files"]) == {"model.safetensors", "keras_optimizer.safetensors", "loop.safetensors"}
    assert manifest["run_id"] and len(manifest["rng_states"]) == 1


DIGITS_SPEC = {"framework": "tensorflow", "seed": 0, "model": {"name": "mlp", "params": {"hidden_sizes": [16]}},
               "data": {"name": "digits", "batch_size": 64}, "optimizer": {"name": "sgd", "lr": 0.1},
               "loop": {"epochs": 2}}


class StartWeights:
    """Records the weights the Trainer starts its first step from."""

    def __init__(self) -> None:
        self.trainer, self.state = None, None

    def on_train_start(self, run: object) -> None:
        self.state = self.trainer.framework.export_state()


def test_the_trainer_resumes_a_loops_checkpoint_and_a_loop_loads_the_trainers(tmp_path: Path) -> None:
    from polytrain import validation
    from polytrain.adapters.tensorflow.models import MLP
    from polytrain.spec.zoo import model_params
    from polytrain.train.trainer import Trainer
    from polytrain.world import World

    with Distributed("local") as dist:
        model = MLP(64, 10, model_params("mlp", {"hidden_sizes": [16]}), 7, "float32")
        model(np.zeros((1, 64), np.float32))
        mine = {k: v.copy() for k, v in _portable(model).items()}
        saved = dist.save(tmp_path / "loop", {"model": model, "step": 23, "epoch": 1})
    spec = validation.from_dict({**DIGITS_SPEC, "output": str(tmp_path / "run"),
                                 "checkpoint": {"dir": str(tmp_path / "trainer"), "every_n_epochs": 1}})
    start = StartWeights()
    trainer = Trainer(spec, World(), show_progress=False, resume=str(saved), callbacks=[start])
    start.trainer = trainer
    result = trainer.fit()
    assert result.global_step == 46  # it went on from step 23, epoch 1, for the second epoch
    for name, value in mine.items():
        np.testing.assert_array_equal(start.state[name], value)
    with Distributed("local") as dist:
        fresh = MLP(64, 10, model_params("mlp", {"hidden_sizes": [16]}), 8, "float32")
        fresh(np.zeros((1, 64), np.float32))
        values = dist.load(tmp_path / "trainer", {"model": fresh})
        assert (values["step"], values["epoch"]) == (46, 2)
        final = json.loads(json.dumps({k: v.tolist() for k, v in _portable(fresh).items()}))
        with pytest.raises(UserError, match=r"holds no Keras optimizer state \(a Trainer's checkpoint holds its own"):
            dist.load(tmp_path / "trainer", {"model": fresh, "optimizer": keras.optimizers.SGD(0.1)})
        with pytest.raises(UserError, match=r"^load: .* does not fit the model: it lacks .* and holds head.bias, "):
            dist.load(tmp_path / "trainer", {"model": sequential()})
    from polytrain.checkpoint.store import read_model

    trained, _ = read_model(tmp_path / "run")
    for name, value in trained.items():
        np.testing.assert_array_equal(np.asarray(final[name], np.float32), value)


def _portable(model: keras.Model) -> dict[str, np.ndarray]:
    from polytrain.adapters.tensorflow.models import to_portable

    return {e.name: to_portable(np.asarray(e.variable.numpy()), e.layout) for e in model.portable_variables()}


def test_misuse_is_one_line(tmp_path: Path) -> None:
    from polytrain.world import World

    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with Distributed("local") as dist:
        with pytest.raises(OwnLoopError, match=r"^setup: the model has no weights yet; build it first"):
            dist.setup(unbuilt, keras.optimizers.SGD(0.1))
        with pytest.raises(OwnLoopError, match=r"^setup: expected a keras.Model, got str$"):
            dist.setup("model", keras.optimizers.SGD(0.1))
        model, optimizer = dist.setup(sequential(), keras.optimizers.SGD(0.1))
        with pytest.raises(OwnLoopError, match=r"^setup: called twice"):
            dist.setup(model, keras.optimizers.SGD(0.1))
        with pytest.raises(OwnLoopError, match=r"^all_reduce: op 'avg' is not one of sum, mean, max, min$"):
            dist.all_reduce(tf.ones(2), "avg")
        with pytest.raises(OwnLoopError, match=r"^all_reduce: runs eagerly; call it outside tf.function"):
            tf.function(lambda: dist.all_reduce(tf.ones(2)))()
        with pytest.raises(OwnLoopError, match=r"^gradient: expected a tf.GradientTape, got NoneType$"):
            dist.gradient(None, tf.ones(()), model.trainable_variables)
        with pytest.raises(OwnLoopError, match=r"^save: 'x' is a tf.Tensor, which cannot be loaded back in place"):
            dist.save(tmp_path, {"model": model, "x": tf.ones(2)})
        with pytest.raises(UserError, match=r"^save: 'fn' is a function; a checkpoint holds the model"):
            dist.save(tmp_path, {"model": model, "fn": lambda: 0})
        with pytest.raises(OwnLoopError, match=r"^save: the optimizer's state is named after the model's variables"):
            dist.save(tmp_path, {"optimizer": optimizer})
        with pytest.raises(UserError, match=r"^load: .* is not a directory"):
            dist.load(tmp_path / "none", {"model": model})
    with pytest.raises(OwnLoopError, match=r"^barrier: this Distributed has ended$"):
        dist.barrier()
    with pytest.raises(UserError, match=r"^backend: 'ddp' is not available for framework 'tensorflow' "
                                        r"\(it exists for torch\)"):
        Distributed("ddp")
    with pytest.raises(UserError, match=r"^backend: 'local' runs with 1..1 processes, but the launcher \(single\) "
                                        r"started 2"):
        Distributed("local", world=World(size=2, local_size=2))
    with pytest.raises(UserError, match=r"^precision: 'fp16' is not supported on backend 'local'"):
        Distributed("local", precision="fp16")
    (tmp_path / "tf.yaml").write_text("framework: tensorflow\nbackend: local\nseed: 4\n")
    with Distributed.from_spec(tmp_path / "tf.yaml") as dist:
        assert (dist.backend_name, dist.spec.seed, dist.world_size, dist.is_main) == ("local", 4, 1, True)
    spec = tmp_path / "torch.yaml"
    spec.write_text("framework: torch\n")
    with pytest.raises(OwnLoopError, match=r"^framework: 'torch' in .*torch.yaml; polytrain.tensorflow runs "
                                           r"tensorflow specs$"):
        Distributed.from_spec(spec)


def test_bf16_builds_layers_in_mixed_bfloat16_until_the_end() -> None:
    before = keras.config.dtype_policy().name
    with Distributed("local", precision="bf16") as dist:
        model, _ = dist.setup(sequential(), keras.optimizers.SGD(0.1))
        assert model.layers[0].compute_dtype == "bfloat16" and model.layers[0].kernel.dtype == "float32"
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.cast(model(tf.ones((2, 6))), tf.float32))
        assert all(g.dtype == tf.float32 for g in dist.gradient(tape, loss, model.trainable_variables))
    assert keras.config.dtype_policy().name == before


def test_preempted_and_exit_preempted_on_tensorflow(capsys: pytest.CaptureFixture) -> None:
    """The TF own loop shares the torch one's preemption: a flag until the agreement call, then True, exit 75."""
    import signal

    before = signal.getsignal(signal.SIGUSR2)
    try:
        dist = Distributed("local", spec={"preemption": {"signals": ["SIGUSR2"]}})
        assert [dist.preempted(step, every_n_steps=2) for step in (1, 2)] == [False, False]
        signal.raise_signal(signal.SIGUSR2)
        assert [dist.preempted(step, every_n_steps=2) for step in (3, 4)] == [False, True]
        with pytest.raises(SystemExit) as ended:
            dist.exit_preempted(4)
        assert ended.value.code == 75 and capsys.readouterr().err.splitlines()[-1].startswith(
            "polytrain: preempted by SIGUSR2: every rank stopped after step 4, its checkpoint written at step 4")
    finally:
        signal.signal(signal.SIGUSR2, before)
