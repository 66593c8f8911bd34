"""The GPU check (issue 20): every PyTorch path of polytrain run on CUDA, and its step time against
Lightning, Accelerate and a hand-written loop. Entry point: ``python -m bench.gpu`` (see check.py),
normally through ``scripts/gpu_check.sh``; how to run it: docs/gpu-check.md."""
