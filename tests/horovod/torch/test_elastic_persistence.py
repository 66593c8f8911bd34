"""hvd.elastic's commits on disk: a private directory, and nothing in it is ever unpickled.

In process, on rank 0 of a "restarted" job (TORCHELASTIC_RESTART_COUNT=1): `ObjectState.persist`
and `load_persisted` need no collective. The restart itself is exercised by test_elastic.py.
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polytrain.errors import UserError  # noqa: E402

# the shim's module itself: the package's ``elastic`` attribute is real Horovod's when that is installed
elastic = importlib.import_module("polytrain.horovod.torch.elastic")

VARIABLE = "POLYTRAIN_HOROVOD_ELASTIC_DIR"


class Payload:
    """What a planted pickle runs when it is loaded: it makes the directory ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def rank0_state(**values: object) -> elastic.ObjectState:
    return elastic.ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, **values)


@pytest.fixture
def restarted_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A job torchrun restarted once, with no elastic directory set: the default, predictable one is used."""
    run_id, port = f"test-{uuid.uuid4().hex[:12]}", "29400"
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    paths = [Path("/tmp") / f"polytrain-elastic-{run_id}-{port}", elastic.state_dir()]
    yield run_id, port
    for path in paths:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            os.chmod(path, 0o700)
            shutil.rmtree(path)


def legit_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **values: object) -> Path:
    """A directory holding what this version's rank 0 writes for a commit of ``values``."""
    directory = tmp_path / "legit"
    monkeypatch.setenv(VARIABLE, str(directory))
    rank0_state(**values).persist()
    monkeypatch.delenv(VARIABLE)
    return directory


def test_a_pickle_planted_at_the_old_predictable_path_is_not_loaded(restarted_job: tuple[str, str],
                                                                    tmp_path: Path) -> None:
    run_id, port = restarted_job
    planted = Path("/tmp") / f"polytrain-elastic-{run_id}-{port}"  # where earlier versions looked
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    marker = tmp_path / "payload-ran"
    torch.save({"objects": {"epoch": Payload(marker)}, "handled": {}}, planted / "state.pt")
    state = rank0_state(epoch=0)
    assert state.load_persisted() is False
    assert not marker.exists() and state.epoch == 0


PLANTS = ["group-and-world-writable", "group-readable", "symlink", "file", "other-owner"]


def plant(path: Path, kind: str, contents: Path) -> None:
    if kind == "symlink":  # to a directory that looks fine, but is not the one asked for
        path.symlink_to(contents, target_is_directory=True)
        return
    if kind == "file":
        path.write_bytes(b"not a directory")
        return
    shutil.copytree(contents, path)
    os.chmod(path, {"group-and-world-writable": 0o777, "group-readable": 0o750, "other-owner": 0o700}[kind])
    if kind == "other-owner":
        os.chown(path, 65534, 65534)


@pytest.mark.parametrize("kind", PLANTS)
def test_a_directory_planted_at_the_predictable_path_is_refused(kind: str, restarted_job: tuple[str, str],
                                                               tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "other-owner" and os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    contents = legit_commit(tmp_path, monkeypatch, epoch=999)
    os.chmod(contents, 0o755)
    planted = elastic.state_dir()
    plant(planted, kind, contents)
    before = sorted(p.name for p in contents.iterdir())
    state = rank0_state(epoch=0)
    with pytest.raises(UserError, match=rf"{VARIABLE}: {planted} .*mode 0700") as refused:
        state.load_persisted()
    assert "\n" not in str(refused.value)
    assert state.epoch == 0
    with pytest.raises(UserError, match="mode 0700"):
        state.persist()  # nothing is written into it either
    if kind != "file":
        assert sorted(p.name for p in planted.iterdir()) == before


def test_an_explicit_directory_open_to_others_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o770)
    monkeypatch.setenv(VARIABLE, str(shared))
    with pytest.raises(UserError, match=rf"{VARIABLE}: {shared} has mode 0770 \(open to group/others\)"):
        rank0_state(epoch=1).persist()
    assert list(shared.iterdir()) == []


def test_commits_go_to_a_fresh_private_directory_and_come_back(restarted_job: tuple[str, str]) -> None:
    rank0_state(epoch=4, losses=[0.5, 0.25], best={"step": 3, "tag": ("a", None)}).persist()
    directory = elastic.state_dir()
    info = os.lstat(directory)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert str(os.getuid()) in directory.name
    assert [p.name for p in directory.iterdir()] == ["state.safetensors"]
    state = rank0_state(epoch=0, losses=[], best=None)
    assert state.load_persisted() is True
    assert (state.epoch, state.losses, state.best) == (4, [0.5, 0.25], {"step": 3, "tag": ("a", None)})


def test_a_first_start_ignores_the_commit(restarted_job: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    rank0_state(epoch=4).persist()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    state = rank0_state(epoch=0)
    assert state.load_persisted() is False and state.epoch == 0


def test_model_optimizer_and_plain_values_round_trip_without_pickle(tmp_path: Path) -> None:
    from safetensors import safe_open

    read_state, write_state = elastic.read_state, elastic.write_state
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    plain = {1: "int key", ("t", 2): [1.5, float("inf"), True, None], "a": np.arange(6).reshape(2, 3),
             "s": np.int64(7), "t": torch.ones(2, dtype=torch.bfloat16), "empty": {}}
    snapshot = {"objects": plain, "handled": {"model": model.state_dict(), "optimizer": optimizer.state_dict()}}
    path = write_state(tmp_path / "d", snapshot)
    with safe_open(str(path), framework="pt") as f:  # a plain safetensors file: JSON metadata, tensors
        assert f.metadata()["format"] == "polytrain.elastic/1"
    back = read_state(tmp_path / "d")

    objects = back["objects"]
    assert objects[1] == "int key" and objects[("t", 2)][1:] == [math.inf, True, None]
    assert objects["a"].dtype == np.int64 and objects["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert isinstance(objects["s"], np.int64) and objects["s"] == 7
    assert objects["t"].dtype == torch.bfloat16 and objects["empty"] == {}
    assert back["handled"]["model"]._metadata == model.state_dict()._metadata  # module versions kept
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(back["handled"]["model"])
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh_opt.load_state_dict(back["handled"]["optimizer"])
    saved, loaded = optimizer.state_dict(), fresh_opt.state_dict()
    assert loaded["param_groups"] == saved["param_groups"] and loaded["param_groups"][0]["betas"] == (0.8, 0.9)
    assert saved["state"].keys() == loaded["state"].keys()
    for pid, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded["state"][pid][key], value), (pid, key)


def test_a_value_that_would_need_pickle_is_refused_and_nothing_is_written(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VARIABLE, str(tmp_path / "d"))
    state = rank0_state(epoch=1, scheduler=Payload(tmp_path / "x"))
    with pytest.raises(TypeError, match=r"cannot persist state\['objects'\]\['scheduler'\] \(a Payload\)"):
        state.persist()
    assert not (tmp_path / "d").exists() or list((tmp_path / "d").iterdir()) == []


@pytest.mark.parametrize("contents", [b"\x80\x04K\x01.", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "])
def test_a_file_that_is_not_a_commit_is_a_one_line_error(contents: bytes, restarted_job: tuple[str, str]) -> None:
    rank0_state(epoch=1).persist()
    (elastic.state_dir() / "state.safetensors").write_bytes(contents)  # a pickle; safetensors without our format
    with pytest.raises(UserError, match="is not an hvd.elastic commit") as error:
        rank0_state(epoch=0).load_persisted()
    assert "\n" not in str(error.value)
