"""`polytrain.checkpoint.export` runs DeepSpeed's unpickling loader (ZeRO 1-3) only behind ``--trust-checkpoint``.

The checkpoint here is planted: its files are pickles that make a marker directory when loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from polytrain.checkpoint.export import ExportError, export_deepspeed, main  # noqa: E402


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def planted_zero_checkpoint(root: Path, marker: Path) -> Path:
    step = root / "global_step5"
    step.mkdir(parents=True)
    (root / "latest").write_text("global_step5\n")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"module": {}, "payload": Payload(marker)}, step / name)
    return root


def test_without_the_flag_a_zero_checkpoint_is_not_unpickled(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "payload-ran"
    src = planted_zero_checkpoint(tmp_path / "ds", marker)
    with pytest.raises(ExportError, match="needs pickle to load .*pass --trust-checkpoint"):
        export_deepspeed(src, tmp_path / "out")
    assert main(["deepspeed", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trust-checkpoint" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_with_the_flag_deepspeeds_loader_reads_it(tmp_path: Path) -> None:
    """The flag is what lets the files be unpickled: the payload runs (then DeepSpeed finds no weights)."""
    pytest.importorskip("deepspeed")
    marker = tmp_path / "payload-ran"
    src = planted_zero_checkpoint(tmp_path / "ds", marker)
    with pytest.raises(Exception):  # noqa: B017 - DeepSpeed's own error for a checkpoint without ZeRO state
        main(["deepspeed", str(src), str(tmp_path / "out"), "--trust-checkpoint"])
    assert marker.is_dir()
