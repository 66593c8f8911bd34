"""Device and process-group backend selection (the GPU path is chosen by the same functions)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from polytrain.adapters.torch.backend import choose_device, choose_process_group_backend  # noqa: E402


def test_cpu_uses_gloo() -> None:
    assert choose_device(False, 1) == "cpu"
    assert choose_process_group_backend("cpu", nccl_available=True) == "gloo"


def test_gpu_uses_its_local_rank_and_nccl() -> None:
    assert choose_device(True, 1) == "cuda:1"
    assert choose_process_group_backend("cuda:1", nccl_available=True) == "nccl"


def test_gpu_without_nccl_falls_back_to_gloo() -> None:
    assert choose_process_group_backend("cuda:0", nccl_available=False) == "gloo"
