"""data.name: dataset — the user's own map-style dataset from data.factory: numpy pairs, a torch Dataset
returning tensors, HF-style dict rows, images, token sequences."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from specs import data_spec

from polytrain.data.user import dataset_source, open_user_dataset
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec
from polytrain.validation import from_dict

FACTORIES = '''
import numpy as np

class Pairs:
    """x: [id, id / 2], y: id % 5 (classification) or id / 4 (regression)."""

    def __init__(self, n=47, regression=False):
        self.n, self.regression = n, regression

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        y = np.float32(i / 4) if self.regression else i % 5
        return np.array([i, i / 2], dtype=np.float64), y

    classes = None


class Rows:
    """HF datasets-like: dict rows, a ClassLabel feature, batches through __getitems__."""

    class _Label:
        num_classes = 6

    features = {"id": None, "pixels": None, "label": _Label()}
    column_names = ["id", "pixels", "label"]

    def __init__(self):
        self.batched = 0

    def __len__(self):
        return 40

    def __getitem__(self, key):
        if isinstance(key, str):
            return [i % 6 for i in range(40)]
        return {"id": key, "pixels": [key, key + 1, key + 2], "label": key % 6, "text": "unused"}

    def __getitems__(self, keys):
        self.batched += 1
        return [self[k] for k in keys]


class Images:
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return np.full((3, 4, 4), i, dtype=np.float32), i % 2


class Tokens:
    def __len__(self):
        return 30

    def __getitem__(self, i):
        seq = np.arange(i * 9, i * 9 + 9) % 100
        return seq[:-1], seq[1:]


def pairs():
    return Pairs()

def regression():
    return Pairs(regression=True)

def rows():
    return Rows()

def images():
    return Images()

def tokens():
    return Tokens()

class PilImages:
    """HF datasets-like rows whose "image" column holds Pillow images (H, W, C), as an HF Image feature gives."""

    column_names = ["image", "label"]

    def __init__(self, n, grey=False):
        self.n, self.grey = n, grey

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        from PIL import Image

        if isinstance(i, str):  # a whole column, as HF datasets answer
            return [k % 3 for k in range(self.n)]
        pixels = (np.arange(5 * 6 * 3).reshape(5, 6, 3) * 3 + i) % 256
        image = Image.fromarray(pixels[..., 0].astype(np.uint8), "L") if self.grey else \
            Image.fromarray(pixels.astype(np.uint8), "RGB")
        return {"image": image, "label": i % 3}


def splits():
    return {"train": PilImages(12), "test": PilImages(5)}

def splits_mismatch():
    return {"train": PilImages(12), "validation": PilImages(5, grey=True)}

def no_train():
    return {"training": PilImages(3)}

def torch_dataset():
    import torch

    class TensorPairs(torch.utils.data.Dataset):
        def __len__(self):
            return 25

        def __getitem__(self, i):
            return torch.tensor([float(i), 2.0 * i], requires_grad=True), torch.tensor(i % 3)

    return TensorPairs()
'''


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_factories.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_factories", raising=False)
    return "user_factories"


def spec(factory: str, **fields: object) -> DataSpec:
    return data_spec("dataset", factory=factory, **fields)


def test_numpy_pairs(factories: str) -> None:
    data = open_user_dataset(spec(f"{factories}:pairs", val_fraction=0.0), seed=0)
    assert (data.info.input_shape, data.info.num_outputs, data.info.task) == ((2,), 5, "classification")
    x, y = data.train.read(np.array([3, 46, 0]))
    assert x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(x, [[3, 1.5], [46, 23], [0, 0]])
    np.testing.assert_array_equal(y, [3, 1, 0])
    assert open_user_dataset(spec(f"{factories}:pairs", classes=9), seed=0).info.num_outputs == 9


def test_regression_from_float_targets(factories: str) -> None:
    data = open_user_dataset(spec(f"{factories}:regression", val_fraction=0.0), seed=0)
    assert (data.info.num_outputs, data.info.task) == (1, "regression")
    _, y = data.train.read(np.array([6]))
    assert y.dtype == np.float32 and y.tolist() == [1.5]


def test_a_torch_dataset_returning_tensors(factories: str) -> None:
    pytest.importorskip("torch")
    data = open_user_dataset(spec(f"{factories}:torch_dataset", val_fraction=0.0), seed=0)
    assert (data.info.input_shape, data.info.num_outputs) == ((2,), 3)
    x, y = data.train.read(np.array([4, 1]))
    assert isinstance(x, np.ndarray) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(x, [[4, 8], [1, 2]])
    np.testing.assert_array_equal(y, [1, 1])


def test_dict_rows_by_column(factories: str) -> None:
    data = open_user_dataset(spec(f"{factories}:rows", features=("pixels",), label="label", val_fraction=0.0), seed=0)
    assert (data.info.input_shape, data.info.num_outputs) == ((3,), 6)  # the ClassLabel's num_classes
    x, y = data.train.read(np.array([7, 2]))
    np.testing.assert_array_equal(x, [[7, 8, 9], [2, 3, 4]])
    np.testing.assert_array_equal(y, [1, 2])
    assert data.train.parent.dataset.batched == 1  # the batch of 2 came through one __getitems__ call
    scalars = open_user_dataset(spec(f"{factories}:rows", features=("id", "label"), label="label"), seed=0)
    assert scalars.info.input_shape == (2,)


def test_images_are_flattened_with_their_shape(factories: str) -> None:
    data = open_user_dataset(spec(f"{factories}:images", val_fraction=0.0), seed=0)
    assert data.info.image_shape == (3, 4, 4) and data.info.input_shape == (48,)
    x, _ = data.train.read(np.array([5]))
    assert x.shape == (1, 48) and (x == 5).all()


def test_token_sequences(factories: str) -> None:
    data = open_user_dataset(spec(f"{factories}:tokens", val_fraction=0.0), seed=0)
    assert (data.info.input_shape, data.info.num_outputs, data.info.task) == ((8,), 100, "next_token")
    x, y = data.train.read(np.array([2]))
    assert x.dtype == y.dtype == np.int64 and x[0, 0] == 18 and y[0, 0] == 19


def test_val_fraction_split(factories: str) -> None:
    data = open_user_dataset(spec(f"{factories}:pairs", val_fraction=0.2), seed=4)
    assert (len(data.train), len(data.val)) == (38, 9)
    got = data.train.read(np.arange(38))[0][:, 0].tolist() + data.val.read(np.arange(9))[0][:, 0].tolist()
    assert sorted(got) == list(range(47))


def test_exactly_once_across_ranks_and_micro_steps(factories: str, exactly_once) -> None:
    data = open_user_dataset(spec(f"{factories}:pairs"), seed=0)
    ids = lambda x, y: x[:, 0].astype(int)
    exactly_once(data.train.parent, ids, list(range(47)))
    exactly_once(data.train, ids, ids(*data.train.read(np.arange(len(data.train)))).tolist())


def test_the_spec_accepts_columns_for_a_dataset(factories: str) -> None:
    raw = {"data": {"name": "dataset", "factory": f"{factories}:rows", "features": ["pixels"], "label": "label"}}
    assert from_dict(raw, validate_components=False).data.features == ("pixels",)


def test_a_live_dataset_for_fit_names_its_argument(factories: str) -> None:
    """`polytrain.fit(train_data=...)` goes through `dataset_source`: messages name the argument."""
    import importlib

    module = importlib.import_module(factories)
    source, info = dataset_source(module.Pairs(), "train_data", DataSpec())
    assert (len(source), info.num_outputs, info.task) == (47, 5, "classification")
    with pytest.raises(SpecError, match=r"^train_data: a int, not a map-style dataset"):
        dataset_source(3, "train_data", DataSpec())
    with pytest.raises(SpecError, match=r"^val_data: item 2 has label 7, not in 0..4$"):
        bad = [(np.zeros(2), 0), (np.zeros(2), 4), (np.zeros(2), 7)]
        source, _ = dataset_source(bad, "val_data", DataSpec(classes=5))
        source.read(np.arange(3))


def test_a_factory_may_name_its_validation_split_and_images_may_be_pillow(factories: str) -> None:
    """An HF DatasetDict-like {"train", "test"} is train and validation (no val_fraction split); Pillow images
    in an "image" column become (C, H, W) floats in [0, 1], like torchvision's ToTensor."""
    data = open_user_dataset(spec(f"{factories}:splits", features=("image",), label="label"), seed=0)
    assert (len(data.train), len(data.val)) == (12, 5)
    assert data.info.image_shape == (3, 5, 6) and data.info.input_shape == (90,) and data.info.num_outputs == 3
    x, y = data.val.read(np.array([4, 1]))
    hwc = (np.arange(90).reshape(5, 6, 3) * 3 + 4) % 256
    np.testing.assert_allclose(x[0], hwc.transpose(2, 0, 1).reshape(-1) / 255, rtol=1e-6)
    np.testing.assert_array_equal(y, [1, 1])


def test_a_factory_split_that_does_not_match_or_no_train_split(factories: str) -> None:
    with pytest.raises(SpecError, match=r"^data\.factory: user_factories:splits_mismatch\['validation'\] holds "
                                        r"samples of shape \(30,\)"):
        open_user_dataset(spec(f"{factories}:splits_mismatch", features=("image",), label="label"), seed=0)
    with pytest.raises(SpecError, match=r"^data\.factory: user_factories:no_train returned a mapping without a "
                                        r"'train' entry \(keys: 'training'\)"):
        open_user_dataset(spec(f"{factories}:no_train"), seed=0)
