"""`polytrain.checkpoint.export` on DeepSpeed checkpoint directories (ZeRO-1/2/3 are exercised in test_sharded_parity)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polytrain.checkpoint.export import ExportError, export_deepspeed, main  # noqa: E402
from polytrain.checkpoint.store import read_model  # noqa: E402


def stage0_checkpoint(root: Path, payload: dict) -> Path:
    (root / "global_step5").mkdir(parents=True)
    (root / "latest").write_text("global_step5\n")
    torch.save(payload, root / "global_step5" / "mp_rank_00_model_states.pt")
    return root


def test_stage0_checkpoint_exports_its_module(tmp_path: Path) -> None:
    weights = {"layer.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "layer.bias": torch.ones(2)}
    src = stage0_checkpoint(tmp_path / "ds", {"module": weights, "ds_version": "0.19.8"})
    path = export_deepspeed(src, tmp_path / "out")
    state, manifest = read_model(path.parent)
    assert state["layer.weight"].dtype == np.float32  # full precision out
    np.testing.assert_array_equal(state["layer.weight"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert (manifest["format"], manifest["tag"], manifest["tensors"]) == ("deepspeed", "global_step5", 2)


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    src = stage0_checkpoint(tmp_path / "ds", {"module": {"w": torch.ones(1)}, "obj": Path("x")})
    with pytest.raises(ExportError, match="refusing to unpickle"):
        export_deepspeed(src, tmp_path / "out")


@pytest.mark.parametrize(("tag", "message"), [(None, "has no 'latest' file; pass --tag"),
                                              ("global_step9", r"global_step9 does not exist")])
def test_missing_checkpoint_is_a_one_line_error(tmp_path: Path, tag: str | None, message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ExportError, match=message):
        export_deepspeed(tmp_path, tmp_path / "out", tag=tag)
    assert main(["deepspeed", str(tmp_path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
