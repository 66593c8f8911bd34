"""The Trainer: its loop (`trainer`), what it keeps of a run (`state`), its checkpoints (`checkpoints`, the claim on
``checkpoint.dir`` in `claim`), callbacks, early stopping and best checkpoints (`callbacks`), the LR schedule
(`schedule`)."""
