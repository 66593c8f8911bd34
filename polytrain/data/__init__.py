"""Data: sources of samples (`source`), the per-rank plan of each step (`plan`), reading ahead
(`prefetch`), the built-in in-memory datasets (`arrays`) and one module per file format."""

from polytrain.data.arrays import Dataset, load_dataset, token_corpus
from polytrain.data.plan import StepPlan, epoch_plan, eval_shard, global_batch_size, shuffled, steps_per_epoch
from polytrain.data.source import ArraySource, Data, DatasetInfo, Source, Subset, split

__all__ = [
    "ArraySource", "Data", "Dataset", "DatasetInfo", "Source", "StepPlan", "Subset", "epoch_plan", "eval_shard",
    "global_batch_size", "load_dataset", "shuffled", "split", "steps_per_epoch", "token_corpus",
]
