"""Checkpoints, framework-neutral: a directory per save written atomically (`store`), its manifest, built by one
builder for the Trainer and the own loops (`record`) and checked when read (`manifest`), crash-safe file
operations and the final model pair (`files`), the write on a thread of its own (`writer`), what the data was
(`fingerprint`), consolidated exports of sharded runs (`export`)."""
