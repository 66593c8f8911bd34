"""data.name: images — class-per-folder trees of PNG/JPEG files written with Pillow."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
from specs import data_spec

Image = pytest.importorskip("PIL.Image")

from polytrain.data.images import ImageFolderSource, make_augment, open_images  # noqa: E402
from polytrain.data.prefetch import sample_rngs  # noqa: E402
from polytrain.spec.tables import AugmentSpec  # noqa: E402

H, W = 5, 6


def pixels(sample: int, channels: int, h: int = H, w: int = W) -> np.ndarray:
    """uint8 (H, W, C) whose first two pixels of channel 0 spell the sample's id."""
    base = (np.arange(h * w).reshape(h, w) * 7 + sample) % 256
    image = np.stack([(base + 50 * c) % 256 for c in range(channels)], axis=-1).astype(np.uint8)
    image[0, 0, 0], image[0, 1, 0] = sample % 256, sample // 256
    return image


def write_tree(root: Path, counts: dict[str, int], channels: int = 3, first: int = 0, suffix: str = ".png",
               size: tuple[int, int] = (H, W)) -> dict[int, tuple[int, np.ndarray]]:
    """Class folders of images; returns id -> (label, pixels). Labels follow sorted folder names."""
    written, sample = {}, first
    for label, name in enumerate(sorted(counts)):
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(counts[name]):
            data = pixels(sample, channels, *size)
            mode = "L" if channels == 1 else "RGB"
            Image.fromarray(data[..., 0] if channels == 1 else data, mode).save(root / name / f"img{k:03d}{suffix}")
            written[sample] = (label, data)
            sample += 1
    return written


spec = partial(data_spec, "images")


def ids(x: np.ndarray, y: np.ndarray, channels: int = 3) -> np.ndarray:
    """The id spelled by the first two pixels of channel 0 of flat (C, H, W) images scaled to [0, 1]."""
    raw = np.rint(x * 255).astype(int)
    return raw[:, 0] + 256 * raw[:, 1]


@pytest.mark.parametrize("channels", [1, 3])
def test_values_read_back_sample_by_sample(tmp_path: Path, channels: int) -> None:
    written = write_tree(tmp_path / "tree", {"cat": 4, "ant": 3, "dog": 5}, channels=channels)
    data = open_images(spec(tmp_path / "tree", channels=channels, val_fraction=0.0), seed=0)
    source = data.train
    assert isinstance(source, ImageFolderSource) and source.classes == ["ant", "cat", "dog"]
    assert data.info.image_shape == (channels, H, W) and data.info.input_shape == (channels * H * W,)
    assert (data.info.num_outputs, data.info.task) == (3, "classification")
    x, y = source.read(np.arange(len(source))[::-1])
    assert x.dtype == np.float32 and x.shape == (12, channels * H * W) and y.dtype == np.int64
    for row, label in zip(x, y):
        sample = int(ids(row[None], None)[0])
        want_label, want = written[sample]
        assert label == want_label
        np.testing.assert_allclose(row.reshape(channels, H, W), want.transpose(2, 0, 1) / 255.0, atol=1e-7)


def test_resize_normalise_and_jpeg(tmp_path: Path) -> None:
    write_tree(tmp_path / "tree", {"a": 2, "b": 2}, suffix=".jpg", size=(20, 30))
    Image.new("RGB", (30, 20), (255, 0, 128)).save(tmp_path / "tree" / "a" / "flat.jpeg", quality=100)
    data = open_images(spec(tmp_path / "tree", image_size=(8, 12), mean=(0.5, 0.25, 0.5), std=(0.5, 0.25, 0.25),
                            val_fraction=0.0), seed=0)
    assert data.info.image_shape == (3, 8, 12)
    source = data.train
    flat = source.files.index(tmp_path / "tree" / "a" / "flat.jpeg")
    x, _ = source.read(np.array([flat]))
    image = x.reshape(3, 8, 12)
    np.testing.assert_allclose(image.mean(axis=(1, 2)), [(1 - 0.5) / 0.5, (0 - 0.25) / 0.25, (128 / 255 - 0.5) / 0.25],
                               atol=0.03)
    assert len(source) == 5


def test_val_path_tree_uses_the_training_classes(tmp_path: Path) -> None:
    write_tree(tmp_path / "train", {"a": 3, "b": 3, "c": 3})
    write_tree(tmp_path / "val", {"c": 2}, first=100)
    data = open_images(spec(tmp_path / "train", val_path=str(tmp_path / "val")), seed=0)
    assert len(data.train) == 9 and len(data.val) == 2
    x, y = data.val.read(np.arange(2))
    assert y.tolist() == [2, 2] and ids(x, y).tolist() == [100, 101]
    split = open_images(spec(tmp_path / "train", val_fraction=1 / 3), seed=0)
    assert (len(split.train), len(split.val)) == (6, 3)


@pytest.mark.slow
def test_exactly_once_across_ranks_and_micro_steps(tmp_path: Path, exactly_once) -> None:
    write_tree(tmp_path / "tree", {"a": 13, "b": 9, "c": 11}, channels=1)
    data = open_images(spec(tmp_path / "tree", channels=1), seed=0)
    exactly_once(data.train.parent, ids, list(range(33)))
    exactly_once(data.train, ids, ids(*data.train.read(np.arange(len(data.train)))).tolist())


def test_augment_is_a_seeded_crop_and_flip(tmp_path: Path) -> None:
    c, h, w, p = 2, 5, 6, 2
    x = np.random.default_rng(0).random((64, c * h * w), dtype=np.float32)
    fill = np.array([-1.0, -2.0], dtype=np.float32)
    augment = make_augment((c, h, w), AugmentSpec(crop_padding=p, horizontal_flip=True), fill)
    assert augment is not None and make_augment((c, h, w), AugmentSpec(), fill) is None
    out, y = augment(x, np.arange(64), sample_rngs(5, 0, 1, np.arange(64)))
    again, _ = augment(x, np.arange(64), sample_rngs(5, 0, 1, np.arange(64)))
    np.testing.assert_array_equal(out, again)
    assert out.shape == x.shape and out.dtype == np.float32 and y.tolist() == list(range(64))
    flips, shifts = 0, set()
    for original, got in zip(x.reshape(-1, c, h, w), out.reshape(-1, c, h, w)):
        padded = np.empty((c, h + 2 * p, w + 2 * p), np.float32)
        padded[:] = fill[:, None, None]
        padded[:, p:p + h, p:p + w] = original
        matches = [(dy, dx, flip) for dy in range(2 * p + 1) for dx in range(2 * p + 1) for flip in (False, True)
                   if np.array_equal(padded[:, dy:dy + h, dx:dx + w][..., ::-1] if flip
                                     else padded[:, dy:dy + h, dx:dx + w], got)]
        assert matches, "each output is a crop of the padded image, maybe mirrored"
        flips += matches[0][2]
        shifts.add(matches[0][:2])
    assert 10 < flips < 54 and len(shifts) > 5


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_augmenting_the_decoded_pixels_gives_the_bytes_of_augmenting_the_normalised_batch(tmp_path: Path,
                                                                                        kind: str) -> None:
    """The sources crop and flip the uint8 pixels while decoding (in the decoding processes too); that is byte for
    byte the float path's crop of the normalised image padded with the normalised black, also through a split's
    `Subset`, and the sample's Generators are left as the float path leaves them (for a transform after)."""
    write_tree(tmp_path / "tree", {"a": 20, "b": 20})
    options = AugmentSpec(crop_padding=2, horizontal_flip=True)
    data = open_images(spec(tmp_path / "tree", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), val_fraction=0.25,
                            workers=2, worker_kind=kind, augment=options), seed=0)
    try:
        augment = data.augment
        assert augment is not None and data.train.augments_while_decoding
        order = np.random.default_rng(1).permutation(len(data.train))
        plain, y = data.train.read(order)
        want, _ = augment(plain, y, sample_rngs(3, 0, 2, order))
        rngs = sample_rngs(3, 0, 2, order)
        got, y2 = data.train.read(order, draws=augment.draws(rngs))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(y2, y)
        assert not np.array_equal(got, plain)
        after = sample_rngs(3, 0, 2, order)
        augment(plain, y, after)
        assert [r.random() for r in rngs] == [r.random() for r in after]
    finally:
        data.train.parent.close()  # type: ignore[attr-defined]


def test_a_png_named_jpg_still_opens(tmp_path: Path) -> None:
    write_tree(tmp_path / "tree", {"a": 1, "b": 1}, channels=1)
    (tmp_path / "tree" / "a" / "img000.png").rename(tmp_path / "tree" / "a" / "img000.jpg")
    data = open_images(spec(tmp_path / "tree", channels=1, val_fraction=0.0), seed=0)
    x, y = data.train.read(np.arange(2))
    assert ids(x, y).tolist() == [0, 1] and y.tolist() == [0, 1]


def test_webp_bmp_gif_and_tiff_are_read_like_png(tmp_path: Path) -> None:
    """Every raster format Pillow opens here is read (WebP and BMP files were skipped without a word)."""
    from polytrain.data.images import image_suffixes

    assert {".png", ".jpg", ".webp", ".bmp", ".gif", ".tif"} <= set(image_suffixes())
    root = tmp_path / "tree"
    saves = {".png": {}, ".webp": {"lossless": True}, ".bmp": {}, ".gif": {}, ".tiff": {}}
    written = {}
    for k, (suffix, options) in enumerate(saves.items()):
        for label in (0, 1):
            sample = 2 * k + label
            (root / f"class{label}").mkdir(parents=True, exist_ok=True)
            grey = pixels(sample, 1)[..., 0]
            Image.fromarray(grey, "L").save(root / f"class{label}" / f"img{sample}{suffix}", **options)
            written[sample] = (label, grey)
    (root / "class0" / "notes.txt").write_text("not an image")
    source = open_images(spec(root, channels=1, val_fraction=0.0), seed=0).train
    assert len(source) == 10
    x, y = source.read(np.arange(10))
    for row, label in zip(x, y):
        want_label, want = written[int(ids(row[None], None)[0])]
        assert label == want_label
        np.testing.assert_allclose(row.reshape(H, W), want / 255.0, atol=1e-7)


def test_a_tree_without_images_names_what_it_skipped(tmp_path: Path) -> None:
    from polytrain.errors import SpecError

    for name in ("a/x.heic", "a/y.heic", "b/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"...")
    with pytest.raises(SpecError, match=r"^data.path: no image files under the class folders of .* \(only 2 .heic, "
                                        r"1 .txt\); read: .png .jpg .jpeg .*\.webp .*\.bmp"):
        open_images(spec(tmp_path), seed=0)
