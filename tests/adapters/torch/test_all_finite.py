"""`all_finite`, the gradient check every torch backend runs before an update: one sum per tensor, one sync."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from polytrain.adapters.torch.backend import all_finite  # noqa: E402


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_bad_element_anywhere_is_caught(bad: float, dtype: torch.dtype) -> None:
    tensors = [torch.randn(7, 5, dtype=dtype), torch.randn(300, dtype=dtype), torch.zeros(0, dtype=dtype)]
    assert all_finite(tensors)
    for t in tensors[:2]:
        for i in (0, t.numel() // 2, t.numel() - 1):
            t.view(-1)[i] = bad
            assert not all_finite(tensors), (dtype, bad, i)
            t.view(-1)[i] = 0.5


def test_opposite_infinities_in_different_tensors_are_caught() -> None:
    assert not all_finite([torch.tensor([math.inf]), torch.tensor([-math.inf])])  # their sum is NaN


def test_large_finite_gradients_are_finite() -> None:
    """Norms overflow fp32 near 1e19 (the check this replaced called such gradients non-finite); sums do not."""
    big = [torch.full((1000,), 1e20), torch.full((10,), -3e25)]
    assert all_finite(big)
    assert not bool(torch.isfinite(torch.stack(torch._foreach_norm(big)).sum()))
    assert all_finite([]) and all_finite([torch.zeros(0)])
