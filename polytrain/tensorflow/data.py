"""One rank's share of a ``tf.data.Dataset``: `shard` (`Distributed.shard_dataset`).

The dataset (one element per sample) is shuffled with the job's seed — the same order on every rank, a new one at
each pass — and cut into global batches of ``global_batch_size``, the batches one process would take; rank ``r`` of
``W`` keeps rows ``r, r + W, r + 2W, ...`` of each. So every rank takes as many steps as the others (each sees every
global batch), and the ranks' rows of a step are exactly that step's global batch. With ``drop_remainder`` false
the last global batch may be short: its rows are split alike, so ranks can get one row fewer than others there.
Every rank reads the whole dataset, as ``Dataset.shard`` does too (it skips the others' elements after reading
them); a set too large for that is better split by files first.

The shuffle's order depends on the job's seed alone. TensorFlow mixes its global seed in, and a script may well
set that differently on each rank (``keras.utils.set_random_seed(seed + rank)``, for dropout), so it is left out
(`_shuffled`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from polytrain.errors import OwnLoopError


def shard(dataset: tf.data.Dataset, rank: int, size: int, global_batch_size: int, *, seed: int,
          shuffle_buffer: int | None = None, drop_remainder: bool = False) -> tf.data.Dataset:
    """Rank ``rank``'s batches of ``dataset`` (see the module)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise OwnLoopError(f"shard_dataset: expected a tf.data.Dataset of single samples, got "
                           f"{type(dataset).__name__}")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise OwnLoopError(f"shard_dataset: global_batch_size must be a whole number ≥ 1, got "
                           f"{global_batch_size!r}")
    if global_batch_size % size:
        raise OwnLoopError(f"shard_dataset: global_batch_size {global_batch_size} does not split evenly over "
                           f"{size} ranks; give a multiple of {size}")
    if shuffle_buffer is not None and (isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int)
                                       or shuffle_buffer < 1):
        raise OwnLoopError(f"shard_dataset: shuffle_buffer must be a whole number ≥ 1 or None, got "
                           f"{shuffle_buffer!r}")
    count = int(dataset.cardinality())
    tail = count % global_batch_size if count >= 0 else 0
    if not drop_remainder and 0 < tail < size:
        raise OwnLoopError(f"shard_dataset: the last global batch would hold {tail} sample(s) of {count}, fewer "
                           f"than the {size} ranks, so a rank would get an empty batch; pass drop_remainder=True "
                           f"or another global_batch_size")
    if shuffle_buffer is not None:
        dataset = _shuffled(dataset, shuffle_buffer, seed)
    batches = dataset.batch(global_batch_size, drop_remainder=drop_remainder)
    if size == 1:
        return batches

    def rows(*parts: Any) -> Any:
        mine = tf.nest.map_structure(lambda t: t[rank::size], parts)
        return mine if len(parts) > 1 else mine[0]

    return batches.map(rows)


def _shuffled(dataset: tf.data.Dataset, buffer: int, seed: int) -> tf.data.Dataset:
    """``dataset.shuffle`` seeded by ``seed`` alone, as if no global seed were set: TensorFlow reads the global seed
    once, when the shuffle is made, and exports no way to leave it out, so the eager context's seed attribute is
    set aside for that call (nothing else: ``tf.random.set_seed`` would also restart the random kernels)."""
    if not tf.executing_eagerly():
        return dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
    from tensorflow.python.eager import context

    ctx = context.context()
    saved = ctx._seed
    ctx._seed = None
    try:
        return dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
    finally:
        ctx._seed = saved
