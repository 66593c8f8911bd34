"""Every rank runs each polytrain.horovod.tensorflow function once and prints ``RESULT <json>``.

Started by tests/horovod_tf/test_collectives.py under mpirun / horovodrun / no launcher; the
test computes Horovod's documented result for every entry from (rank, size).
"""

from __future__ import annotations

import json

import keras
import numpy as np
import tensorflow as tf

import polytrain.horovod.tensorflow as hvd


def values(t) -> list:
    return np.asarray(t).tolist()


def error_of(fn) -> str:
    try:
        out = fn()
        if hasattr(out, "numpy"):
            out.numpy()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return ""


def gradients(r: int, n: int) -> dict:
    x = tf.constant([1.0, 2.0]) * (r + 1)
    out = {}
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        sum_loss = tf.reduce_sum(hvd.allreduce(x * x, op=hvd.Sum))
        avg_loss = tf.reduce_sum(hvd.allreduce(x * x, op=hvd.Average))
        gathered = hvd.allgather(tf.tile(x[None], [r + 1, 1]))
        weights = tf.reshape(tf.range(tf.size(gathered), dtype=tf.float32) + 1.0, tf.shape(gathered))
        gather_loss = tf.reduce_sum(gathered * weights)
        bcast_loss = tf.reduce_sum(hvd.broadcast(x, 0) * float(r + 1))
        rows = tf.tile(x[None], [2 * n + 1, 1])
        scatter_loss = tf.reduce_sum(hvd.reducescatter(rows, op=hvd.Sum))
        chunks = tf.tile(x[None], [2 * n, 1])
        a2a_loss = tf.reduce_sum(hvd.alltoall(chunks) * float(r + 1))
    out["grad_allreduce_sum"] = values(tape.gradient(sum_loss, x))
    out["grad_allreduce_avg"] = values(tape.gradient(avg_loss, x))
    out["grad_allgather"] = values(tape.gradient(gather_loss, x))
    out["grad_broadcast"] = values(tape.gradient(bcast_loss, x))
    out["grad_reducescatter"] = values(tape.gradient(scatter_loss, x))
    out["grad_alltoall"] = values(tape.gradient(a2a_loss, x))
    return out


def main() -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    res: dict = {"rank": r, "impl": hvd.IMPL}
    res["basics"] = dict(rank=r, size=n, local_rank=hvd.local_rank(), local_size=hvd.local_size(),
                         cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(),
                         is_homogeneous=bool(hvd.is_homogeneous()), is_initialized=hvd.is_initialized(),
                         mpi_enabled=bool(hvd.mpi_enabled()), ops=[hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min,
                                                                   hvd.Max, hvd.Product])
    x = tf.constant([1.0, 2.0]) * (r + 1)
    res["avg"] = values(hvd.allreduce(x))
    res["sum"] = values(hvd.allreduce(x, op=hvd.Sum))
    res["min"] = values(hvd.allreduce(x, op=hvd.Min))
    res["max"] = values(hvd.allreduce(x, op=hvd.Max))
    res["product"] = values(hvd.allreduce(x, op=hvd.Product))
    res["average_false"] = values(hvd.allreduce(x, average=False))
    res["scaled_sum"] = values(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25))
    res["scaled_avg"] = values(hvd.allreduce(x, prescale_factor=3.0))
    res["int_sum"] = values(hvd.allreduce(tf.constant([r + 1], tf.int32), op=hvd.Sum))
    fp16 = hvd.allreduce(x, compression=hvd.Compression.fp16)
    res["fp16"] = [values(fp16), fp16.dtype.name]
    res["variable_sum"] = values(hvd.allreduce(tf.Variable(x), op=hvd.Sum))
    sparse = hvd.allreduce(tf.IndexedSlices(tf.constant([[float(r + 1)]]), tf.constant([r]), tf.constant([n, 1])))
    res["sparse"] = [values(sparse.values), values(sparse.indices), values(tf.convert_to_tensor(sparse))]
    grouped = hvd.grouped_allreduce([x, tf.constant([r], tf.int32), tf.constant([[0.5 * r]], tf.float64)],
                                    op=hvd.Sum)
    res["grouped"] = [values(g) for g in grouped] + [[g.dtype.name for g in grouped]]
    res["allgather"] = values(hvd.allgather(tf.fill([r + 1, 2], float(r))))
    res["grouped_allgather"] = [values(g) for g in hvd.grouped_allgather([tf.fill([r + 1], r), tf.constant([[r]])])]
    res["broadcast"] = values(hvd.broadcast(x, n - 1))
    var = tf.Variable(x)
    hvd.broadcast_([var], 0)
    res["broadcast_inplace"] = values(var)
    res["alltoall_even"] = values(hvd.alltoall(tf.range(2 * n) + 100 * r))
    out, received = hvd.alltoall(tf.range(n * (n + 1) // 2) + 100 * r, splits=[s + 1 for s in range(n)])
    res["alltoall_splits"] = [values(out), values(received)]
    rows = tf.reshape(tf.range((2 * n + 1) * 2, dtype=tf.float32), [2 * n + 1, 2]) * (r + 1)
    res["reducescatter_sum"] = values(hvd.reducescatter(rows, op=hvd.Sum))
    res["reducescatter_avg"] = values(hvd.reducescatter(rows))
    res["grouped_reducescatter"] = [values(g) for g in hvd.grouped_reducescatter([rows, rows * 2], op=hvd.Sum)]

    @tf.function
    def in_graph(t):
        return hvd.allreduce(t, op=hvd.Sum), hvd.allgather(t), hvd.broadcast(t, 0)

    res["tf_function"] = [values(v) for v in in_graph(x)]
    res.update(gradients(r, n))
    hvd.barrier()
    plain, keras_var = tf.Variable(float(r)), keras.Variable(np.full([2], 10.0 * r, np.float32))
    hvd.broadcast_variables([plain, keras_var], root_rank=n - 1)
    res["broadcast_variables"] = [values(plain), values(keras_var)]
    res["broadcast_object"] = hvd.broadcast_object({"from": r, "items": [r, "x"]}, root_rank=n - 1)
    res["allgather_object"] = hvd.allgather_object(("rank", r))
    res["mismatch_error"] = error_of(lambda: hvd.allreduce(tf.ones([r + 1]), op=hvd.Sum))
    res["adasum_error"] = error_of(lambda: hvd.allreduce(x, op=hvd.Adasum)) if hvd.IMPL != "horovod" else "skipped"
    if r == 0:  # the others have joined: they contribute zeros
        res["after_join"] = values(hvd.allreduce(tf.constant([7.0]), op=hvd.Sum))
    res["join"] = int(hvd.join().numpy())
    print("RESULT " + json.dumps(res), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
