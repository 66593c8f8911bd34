"""ZeRO-Infinity (issue 35): DeepSpeed ZeRO-3 with the optimizer state, and the parameters too, offloaded to files
under ``deepspeed.nvme_path`` (a directory of this machine's disk stands in for the NVMe drive).

The job: an MLP on digits whose 2048×1024 layer is large enough to go to the drive (DeepSpeed swaps tensors of at
least 1 MiB per rank), SGD with momentum (so there is optimizer state), 24 steps, a checkpoint every 12; 2 ranks
under torchrun. Each nvme run must give the losses and weights of the same run without offload (fp32, within 1e-5
as the sharded parity tests; measured: identical), with files really written (a callback lists them: parameters in
fp32, the optimizer's partitions), none left after the run; checkpoints move between an nvme run and ddp at one
process both ways; a killed run's files are gone after its restart; files made read-only mid-run (``chattr +i``:
not even root may write them) end the run with one line on every rank, the last checkpoint intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import check, step_losses, train

from polytrain.checkpoint.store import complete_checkpoints, load_checkpoint, read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]
pytest.importorskip("deepspeed")

HOOKS_DIR = str(Path(__file__).parent)
JOB = ["model.params.hidden_sizes=[2048,1024]", "loop.epochs=2", "loop.max_steps=24", "loop.log_every_n_steps=1",
       "optimizer.name=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9", "data.global_batch_size=64",
       "checkpoint.every_n_steps=12"]
ZERO3 = ["backend=deepspeed", "deepspeed.stage=3"]
NVME = {"optimizer": ["deepspeed.offload_optimizer=nvme"],
        "optimizer+params": ["deepspeed.offload_optimizer=nvme", "deepspeed.offload_param=nvme"]}
STEPS, TOLERANCE, SPLIT = 24, 1e-5, 12
BIG = 2048 * 1024  # the one parameter large enough to be swapped (1M fp32 elements per rank ≥ 1 MiB)


def run(out: Path, sets: list[str], nproc: int = 2, *, nvme: Path | None = None, hooks: str = "Files",
        resume: Path | str | None = None, env: dict[str, str] | None = None,
        launch: bool = False) -> subprocess.CompletedProcess[str]:
    """The job under torchrun (``launch``: through ``polytrain launch --launcher torchrun``, which names the failed
    ranks instead of torchrun's traceback)."""
    extra = [f"deepspeed.nvme_path={nvme}", f"callbacks=[nvme_hooks:{hooks}]"] if nvme is not None else []
    spec = None
    if launch:
        spec = out.parent / "job.yaml"
        spec.write_text("backend: deepspeed\n")
    return train(out, [*JOB, *sets, *extra], nproc=nproc, resume=resume, timeout=500, spec=spec,
                 launcher="launch-torchrun" if launch else None, env={"PYTHONPATH": HOOKS_DIR, **(env or {})})


def result(out: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    return step_losses(out), read_model(out)[0]


def files(out: Path, rank: int) -> dict[str, dict[str, int]]:
    """What the `nvme_hooks.Files` callback saw of this rank's offloaded files at the start and end of training."""
    return json.loads((out / f"nvme-rank{rank}.json").read_text())


def assert_same_run(got: tuple[np.ndarray, dict], want: tuple[np.ndarray, dict], label: str) -> None:
    (losses, state), (ref_losses, ref_state) = got, want
    assert losses.shape == ref_losses.shape
    loss_rel = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    weight_rel = max(float(np.max(np.abs(state[k] - ref_state[k])) / np.max(np.abs(ref_state[k]))) for k in ref_state)
    print(f"\n{label}: losses within {loss_rel:.1e} relative, weights within {weight_rel:.1e}")
    assert set(state) == set(ref_state) and loss_rel < TOLERANCE and weight_rel < TOLERANCE


def unfreeze(path: Path) -> None:
    subprocess.run(["chattr", "-R", "-i", str(path)], check=False, capture_output=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The same job on ZeRO-3 without offload."""
    out = tmp_path_factory.mktemp("zero3")
    check(run(out, ZERO3))
    losses, state = result(out)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.1
    return losses, state


@pytest.fixture(scope="module")
def nvme_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each nvme variant's output and nvme_path."""
    out = {}
    for name, sets in NVME.items():
        base = tmp_path_factory.mktemp(name.replace("+", "-"))
        check(run(base / "out", [*ZERO3, *sets], nvme=base / "nvme"))
        out[name] = (base / "out", base / "nvme")
    return out


@pytest.mark.parametrize("name", NVME)
def test_nvme_offload_matches_the_run_without_it(name: str, reference: tuple, nvme_runs: dict) -> None:
    from polytrain import validation
    from polytrain.adapters.torch.zero_infinity import needed_bytes
    from polytrain.plan.candidates import spec_layout
    from polytrain.plan.census import take_census
    from polytrain.plan.command import predict

    out, nvme = nvme_runs[name]
    assert_same_run(result(out), reference, name)
    config = json.loads((out / "deepspeed_config.json").read_text())["zero_optimization"]
    assert config["offload_optimizer"]["device"] == "nvme"
    assert config["offload_optimizer"]["nvme_path"].startswith(f"{nvme}/polytrain-")
    assert config.get("offload_param", {}).get("device") == ("nvme" if "params" in name else None)
    numel = sum(v.size for v in read_model(out)[0].values())
    spec = validation.from_dict(read_model(out)[1]["spec"])
    layout = spec_layout(spec, 2)
    assert layout.name == f"zero3 +offload(nvme-{name})"
    drive = predict(spec, take_census(spec, 2), layout, 2).drive
    for rank in (0, 1):
        seen = files(out, rank)
        optimizer = {k: v for k, v in seen["end"].items() if "/optimizer/" in k and "_gradient_" not in k}
        params = {k: v for k, v in seen["end"].items() if "params/" in k}
        # the fp32 master partition from the start, its momentum from the first step: 4 + 4 bytes for each element
        # of this rank's half of the weights (padded); beside them the gradients being swapped
        job = next(iter(seen["start"])).split("/")[0]
        first = f"{job}/zero_stage_3/optimizer/rank{rank}/0_5.tensor.swp"
        assert [k for k in seen["start"] if "/optimizer/" in k] == [first]
        assert sum(optimizer.values()) >= 8 * (numel // 2), optimizer
        assert any("_gradient_" in k for k in seen["end"])
        if "params" in name:  # the big layer's half, in fp32 (DeepSpeed's CPU default of bf16 would halve it)
            assert [k.split("/")[2] for k in params] == ["float32params"] and sum(params.values()) == 4 * BIG // 2
        else:
            assert not params
        assert sum(seen["end"].values()) <= needed_bytes(spec, numel, 2)  # the room checked before the run
        # polytrain plan's prediction of what is on the drive (the spec's own layout)
        assert sum(seen["end"].values()) == pytest.approx(drive, rel=1e-3)
    assert not list(nvme.iterdir()), "offloaded files left after the run"


def test_checkpoints_move_between_nvme_and_ddp_at_one_process(reference: tuple, nvme_runs: dict,
                                                              tmp_path: Path) -> None:
    """An nvme run's checkpoint resumes on ddp at one process, and a ddp run's on nvme, each continuing the run it
    came from (Horovod's and DeepSpeed's users move jobs between layouts; polytrain's checkpoints are full)."""
    ref_losses, _ = reference
    out, _ = nvme_runs["optimizer+params"]
    middle = complete_checkpoints(out / "checkpoints")[0]
    assert middle.name == f"step-{SPLIT:08d}"
    check(run(tmp_path / "ddp", ["backend=ddp"], nproc=1, resume=middle))
    ddp_losses, ddp_state = result(tmp_path / "ddp")
    nvme_losses, nvme_state = result(out)
    assert_same_run((ddp_losses, ddp_state), (nvme_losses[SPLIT:], nvme_state), "nvme -> ddp@1")

    check(run(tmp_path / "ddp-full", ["backend=ddp"], nproc=1))
    full = result(tmp_path / "ddp-full")
    assert_same_run(full, reference, "ddp@1 vs zero3")
    back = complete_checkpoints(tmp_path / "ddp-full" / "checkpoints")[0]
    check(run(tmp_path / "back", [*ZERO3, *NVME["optimizer+params"]], nvme=tmp_path / "nvme", resume=back))
    assert_same_run(result(tmp_path / "back"), (full[0][SPLIT:], full[1]), "ddp@1 -> nvme")
    assert not list((tmp_path / "nvme").iterdir())
    assert len(ref_losses) == STEPS


def test_a_killed_runs_files_are_removed_when_it_restarts(reference: tuple, tmp_path: Path) -> None:
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    sets = [*ZERO3, *NVME["optimizer+params"]]
    killed = run(out, sets, nvme=nvme, hooks="Kill", env={"NVME_KILL_STEP": str(SPLIT + 2)})
    assert killed.returncode != 0
    left = sorted(p for p in nvme.rglob("*") if p.is_file())
    assert any("/rank1/" in str(p) for p in left), "the killed rank's files should still be there"
    job = next(nvme.glob("polytrain-*"))
    stale = job / "zero_stage_3" / "optimizer" / "rank7"  # as a killed run at a larger world would leave
    stale.mkdir(parents=True)
    (stale / "0_9.tensor.swp").write_bytes(b"\0" * 4096)
    check(run(out, sets, nvme=nvme, resume="auto"))
    assert not list(nvme.iterdir()), "files of the killed run left after its restart"
    losses, state = result(out)
    ref_losses, ref_state = reference
    assert_same_run((losses[-(STEPS - SPLIT):], state), (ref_losses[SPLIT:], ref_state), "killed, restarted")


def test_files_that_turn_read_only_mid_run_end_it_in_one_line_on_every_rank(tmp_path: Path) -> None:
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    try:
        failed = run(out, [*ZERO3, *NVME["optimizer"]], nvme=nvme, hooks="Freeze", launch=True,
                     env={"NVME_FREEZE_STEP": str(SPLIT)})
        folder = next(nvme.glob("polytrain-*"))
    finally:
        unfreeze(nvme)
    assert failed.returncode == 1, failed.stderr[-3000:]
    kept = complete_checkpoints(out / "checkpoints")
    assert [p.name for p in kept] == [f"step-{SPLIT:08d}"]
    line = (f"polytrain: error: deepspeed.nvme_path: cannot write the offloaded state under {folder} (Operation not "
            f"permitted); the last checkpoint {kept[0]} is intact; free space or make it writable, then resume with "
            "--resume auto")
    lines = failed.stderr.splitlines()
    assert lines.count(line) == 2, failed.stderr[-3000:]  # every rank
    assert "Traceback" not in failed.stderr
    manifest, tensors = load_checkpoint(kept[0])
    assert manifest["global_step"] == SPLIT and tensors["model"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (tmpfs)")
def test_a_drive_that_fills_up_mid_run_ends_it_in_one_line(tmp_path: Path) -> None:
    """The drive: a 40 MiB tmpfs in a mount namespace of the job's own (gone with it), room for the ~26 MiB one
    rank writes; filled up by a callback after the checkpoint of step 12. DeepSpeed rewrites its files in place
    (nothing fails), but a write cut short on a full drive would go unnoticed by its async I/O: the run stops
    after the step, before anything reads it back or a checkpoint keeps it."""
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    nvme.mkdir()
    mounted = ("unshare", "-m", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs -o size=40m polytrain-test "$NVME_DIR" && exec "$@"', "sh", sys.executable)
    sets = [*JOB, *ZERO3, *NVME["optimizer"], f"deepspeed.nvme_path={nvme}", "callbacks=[nvme_hooks:Fill]"]
    failed = train(out, sets, python=mounted, timeout=300,
                   env={"PYTHONPATH": HOOKS_DIR, "NVME_DIR": str(nvme), "NVME_FILL_STEP": str(SPLIT)})
    assert failed.returncode == 1, failed.stderr[-3000:]
    kept = complete_checkpoints(out / "checkpoints")
    assert [p.name for p in kept] == [f"step-{SPLIT:08d}"]
    folder = zero_infinity_folder(out)
    assert failed.stderr.strip().splitlines()[-1] == (
        f"polytrain: error: deepspeed.nvme_path: cannot write the offloaded state under {folder} (No space left on "
        f"device); the last checkpoint {kept[0]} is intact; free space or make it writable, then resume with "
        "--resume auto"), failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and not list(nvme.iterdir())  # the tmpfs went with the namespace


def zero_infinity_folder(out: Path) -> Path:
    """The job's folder under nvme_path, from the config the run wrote."""
    config = json.loads((out / "deepspeed_config.json").read_text())
    return Path(config["zero_optimization"]["offload_optimizer"]["nvme_path"])


def test_an_nvme_path_that_cannot_be_made_is_one_line_before_training(tmp_path: Path) -> None:
    """Checked on every rank before the engine is built: the same line on each (the rank that found it named),
    exit code 2 (one process; polytrain launch names the rank's code 2)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    failed = run(tmp_path / "out", [*ZERO3, *NVME["optimizer"]], nvme=blocker / "nvme", launch=True)
    line = re.compile(r"polytrain: error: deepspeed\.nvme_path: cannot create "
                      rf"{re.escape(str(blocker))}/nvme/polytrain-[0-9a-f]{{12}} \(Not a directory\); "
                      r"choose a writable directory \(rank 0\)$")
    found = [x for x in failed.stderr.splitlines() if line.match(x)]
    assert len(found) == 2 and found[0] == found[1], failed.stderr[-3000:]
    assert "exited with code 2" in failed.stderr and "Traceback" not in failed.stderr
    single = run(tmp_path / "one", [*ZERO3, *NVME["optimizer"]], nproc=1, nvme=blocker / "nvme")
    assert single.returncode == 2 and line.match(single.stderr.strip().splitlines()[-1]), single.stderr[-3000:]
