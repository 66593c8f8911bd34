"""A new data source is one module and one row (docs/DESIGN.md, "How to add … a data source"): a toy source
written as its own module file, and a `registry.SourceEntry` row naming it, is a ``data.name`` choice that a
spec can train on — its samples planned, read and learned from — with its own fields checked; nothing else
is edited."""

from __future__ import annotations

import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from polytrain import registry, validation
from polytrain.errors import SpecError

torch = pytest.importorskip("torch")

# The toy source's module, as a contributor would write it: two interleaved spirals would be harder than
# needed; two well separated Gaussian blobs whose class is which blob, 400 samples, 8 features.
TOY = '''
import numpy as np

from polytrain.data.source import ArraySource, Data, DatasetInfo

READS = []  # the indices every read asked for, to show the Trainer read through this source


class Counted(ArraySource):
    def read(self, indices):
        READS.append(np.asarray(indices).copy())
        return super().read(indices)


def open_toy(spec, seed):
    rng = np.random.default_rng(int(open(spec.path).read()))  # its one field: a file holding the blobs' seed
    y = rng.integers(0, 2, 400)
    x = (rng.standard_normal((400, 8)) + 4.0 * (2 * y[:, None] - 1)).astype(np.float32)
    return Data(Counted(x[:320], y[:320]), ArraySource(x[320:], y[320:]), DatasetInfo((8,), 2, "classification"))
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The module file on the path and its row in `registry.SOURCES`: the whole of the change."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "toy_source.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setattr(registry, "SOURCES", (*registry.SOURCES,
                                              registry.SourceEntry("toy", "toy_source:open_toy", uses=("path",))))
    yield
    sys.modules.pop("toy_source", None)


def test_a_source_registered_by_one_module_and_one_row_trains(toy, tmp_path: Path) -> None:
    import polytrain

    (seed := tmp_path / "seed.txt").write_text("7")
    spec = {"data": {"name": "toy", "path": str(seed), "batch_size": 32}, "model": {"name": "mlp",
            "params": {"hidden_sizes": [8]}}, "loop": {"epochs": 3}, "optimizer": {"name": "sgd", "lr": 0.1},
            "output": str(tmp_path / "out")}
    result = polytrain.fit(spec, show_progress=False)
    toy_source = sys.modules["toy_source"]
    assert result.global_step == 3 * 10  # 320 training samples of the toy source in batches of 32
    read = [int(i) for batch in toy_source.READS for i in batch]
    counts = Counter(read)  # every toy sample, once per epoch, through its read (and a few more: the start-up probe)
    assert sorted(counts) == list(range(320)) and min(counts.values()) >= 3, counts
    assert result.val_accuracy == 1.0  # the blobs are 8 standard deviations apart: any trained model splits them


def test_the_rows_fields_are_its_own(toy, tmp_path: Path) -> None:
    """The row's ``uses`` are the fields it may be given; another source's field is refused by name."""
    assert "toy" in registry.source_names()
    (seed := tmp_path / "seed.txt").write_text("3")
    assert validation.from_dict({"data": {"name": "toy", "path": str(seed)}}).data.path == str(seed)
    with pytest.raises(SpecError, match=r"^data\.features: only used with data\.name"):
        validation.from_dict({"data": {"name": "toy", "features": ["a"]}})
