"""hvd.elastic.KerasState on real ranks: sync, restore, commit, ``run``'s retry, the callbacks, and a restart.

``argv[1]`` is ``train`` or ``resume``. ``train`` checks the in-memory semantics and ends with a
commit that rank 0 writes to ``$POLYTRAIN_HOROVOD_ELASTIC_DIR``; ``resume`` (run with
``POLYTRAIN_RESTART_COUNT=1``) builds the model again with other weights and reports what
``run`` restored. Each rank prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import sys

import keras
import numpy as np

import polytrain.horovod.keras as hvd
from polytrain.horovod.common import HorovodInternalError


def build(value: float) -> keras.Model:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d")])
    model.set_weights([np.full((2, 2), value, "float32"), np.full((2,), value, "float32")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=2),
                  loss="mse")
    return model


def flat(variables) -> list[list[float]]:
    return [np.asarray(v, dtype=np.float64).ravel().tolist() for v in variables]


def state_variables(state) -> dict:
    opt = state.optimizer
    return {"weights": flat(state.model.weights), "optimizer": flat(opt.variables),
            "sums": flat(opt.aggregation_variables)}


def data(r: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(10 + r)
    return rng.randn(6, 2).astype("float32"), rng.randn(6, 2).astype("float32")


def train(r: int, n: int) -> dict:
    out: dict = {}
    model = build(1.0 + r)
    state = hvd.elastic.KerasState(model, batch=20 + r, epoch=10 + r, note=f"rank{r}", history=[r, (r, "x")])
    state.sync()  # rank 0's weights, optimizer state and plain values everywhere
    out["synced"] = [state_variables(state), state.batch, state.epoch, state.note, state.history]

    model.set_weights([np.full((2, 2), 7.0, "float32"), np.full((2,), 7.0, "float32")])
    state.batch, state.epoch = 21, 11
    state.restore()  # back to the synced values
    out["restored"] = [flat(model.weights), state.batch, state.epoch]

    x, y = data(r)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)  # 3 passes: a cycle half done
    state.batch = 3
    state.commit()
    committed = state_variables(state)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)  # changes weights, moments, sums
    changed = state_variables(state)
    state.batch = 99
    state.restore()
    out["commit_restore"] = [committed, changed, state_variables(state), state.batch]

    attempts, resets = [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def fit_once(state):
        attempts.append(state_variables(state)["weights"])
        if len(attempts) == 1:  # uncommitted work, then a failed collective on every rank
            state.model.set_weights([np.full((2, 2), -5.0, "float32"), np.full((2,), -5.0, "float32")])
            state.batch = 77
            raise HorovodInternalError("simulated: a peer went away")
        return state.batch

    out["run"] = [fit_once(state), attempts, resets, committed["weights"], hvd.is_initialized()]

    state.batch, state.epoch = 0, 0
    seen = []

    class See(keras.callbacks.Callback):
        def on_batch_end(self, batch, logs=None):
            seen.append([state.batch, state.epoch])

    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2), See()]  # Horovod's order
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    final = state_variables(state)
    state.restore()  # the last commit was at the end of the last epoch
    out["callbacks"] = [seen, state.batch, state.epoch, final, state_variables(state)]
    out["persisted"] = [state_variables(state), state.batch, state.epoch, state.note, state.history]

    state.note = object()  # cannot be kept without pickle: rank 0 fails to write; every rank must hear it
    try:
        state.commit()
        error = None
    except Exception as exc:
        error = type(exc).__name__
    out["bad_commit"] = [error, float(hvd.allreduce(1.0, op=hvd.Sum))]  # and the next collective pairs up
    return out


def resume(r: int, n: int) -> dict:
    model = build(50.0 + r)
    state = hvd.elastic.KerasState(model, batch=-1, epoch=-1, note="fresh", history=[])

    @hvd.elastic.run
    def report(state):
        return [state_variables(state), state.batch, state.epoch, state.note, state.history]

    return {"resumed": report(state)}


def main() -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    res = {"rank": r, "size": n, "impl": hvd.IMPL}
    res.update(train(r, n) if sys.argv[1] == "train" else resume(r, n))
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
