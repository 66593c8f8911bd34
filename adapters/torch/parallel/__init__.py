"""Model parallelism on PyTorch (spec ``parallel``): tensor parallel (`tensor`), pipeline parallel
(`pipeline`, `runner`) and their combination with ``ddp``/``fsdp`` data parallelism (`backend`) on one
DeviceMesh; `state` keeps checkpoints in the portable full form. See `polytrain.spec.layout` for the grid."""
