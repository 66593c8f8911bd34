"""Bad input, end to end through the real ``polytrain`` entry point (issue 7, "Bad input").

One table of malformed inputs — spec files, ``--set`` overrides, command-line flags, hostfiles,
launcher environments and checkpoints. Every case must end with exit code 2 and exactly one line on
stderr that names the field, flag, variable or file and says what is allowed (or what to do), with
no traceback. Each case runs in-process through ``polytrain.cli.main``; a few also run as real
processes, with and without ``--debug`` (which shows the traceback instead).
"""

from __future__ import annotations

import argparse
import fractions
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from environments.launcher_dumps import DUMPS, load_dump
from procs import loopback_env, run

from polytrain import cli
from polytrain.errors import UserError

#: A tiny, fast job: the module fixture trains it for 2 steps with a checkpoint after each.
TINY_SPEC = """\
framework: torch
backend: local
model: {name: mlp, params: {hidden_sizes: [8]}}
data: {name: synthetic, batch_size: 32, synthetic: {samples: 128, features: 8, classes: 2}}
optimizer: {name: sgd, lr: 0.05}
loop: {epochs: 1}
"""
TINY_SETS = ("--set", "loop.max_steps=2", "--set", "checkpoint.every_n_steps=1")

#: A valid spec for the launch cases (they fail on their flags before the spec is read).
OK_SPEC = {"ok.yaml": TINY_SPEC}

#: The minimum number of cases per category (issue 7 and its brief).
MINIMUM = {"spec": 12, "set": 5, "flag": 10, "hostfile": 3, "env": 5, "checkpoint": 5}

Setup = Callable[[Path, Path], None]  # (the case's directory, the module's trained run)


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    #: ``polytrain`` arguments; ``{tmp}`` is the case's directory, ``{run}`` the module's trained run.
    argv: tuple[str, ...]
    #: Every string must appear in the one error line: the field/flag AND what is allowed / what to do.
    expect: tuple[str, ...]
    files: Mapping[str, str | bytes] = field(default_factory=dict)  # written into {tmp} as they are
    env: Mapping[str, str] = field(default_factory=dict)  # launcher variables for this case
    setup: Setup | None = None  # builds what plain files cannot (damaged checkpoints, pickles)
    needs_run: bool = False  # needs the trained run of the module fixture
    xfail: str | None = None  # the fix is outside the files this test's author may edit


def spec_case(id: str, text: str | bytes, expect: tuple[str, ...], name: str = "spec.yaml") -> Case:
    """A spec file that `polytrain train` must reject before anything is imported or started."""
    return Case(id, "spec", ("train", "--quiet", f"{{tmp}}/{name}"), expect, files={name: text})


def set_case(id: str, sets: tuple[str, ...], expect: tuple[str, ...]) -> Case:
    argv = ("train", "--quiet", *(arg for value in sets for arg in ("--set", value)))
    return Case(id, "set", argv, expect)


def launch_case(id: str, flags: tuple[str, ...], expect: tuple[str, ...], files: Mapping[str, str] | None = None,
                category: str = "flag", target: str = "{tmp}/ok.yaml") -> Case:
    """``polytrain launch --dry-run FLAGS SPEC``: nothing may start even if the flags were accepted."""
    argv = ("launch", "--dry-run", *flags, *((target,) if target else ()))
    return Case(id, category, argv, expect, files={**OK_SPEC, **(files or {})})


def hostfile_case(id: str, text: str, expect: tuple[str, ...]) -> Case:
    return launch_case(id, ("--launcher", "mpirun", "--hostfile", "{tmp}/hosts"), expect, files={"hosts": text},
                       category="hostfile")


def torchrun_env(**changes: str | None) -> dict[str, str]:
    """A real torchrun worker's variables (tests/environments/dumps/torchrun_rank1.env), changed."""
    return load_dump("torchrun_rank1", TORCHELASTIC_ERROR_FILE=None, **changes)


def env_case(id: str, env: Mapping[str, str], expect: tuple[str, ...]) -> Case:
    return Case(id, "env", ("train", "--quiet", "--set", "output={tmp}/out"), expect, env=env)


# ----------------------------------------------------------------------------------- checkpoints


def _npy_file(tmp: Path, run_dir: Path) -> None:
    import numpy as np

    np.save(tmp / "x.npy", np.zeros(3))


def _copy_checkpoint(tmp: Path, run_dir: Path, step: int = 2) -> Path:
    target = tmp / "ckpt"
    shutil.copytree(run_dir / "checkpoints" / f"step-{step:08d}", target)
    return target


def _truncated(tmp: Path, run_dir: Path) -> None:
    model = _copy_checkpoint(tmp, run_dir) / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-16])


def _flipped(tmp: Path, run_dir: Path) -> None:
    model = _copy_checkpoint(tmp, run_dir) / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-5] ^= 0xFF
    model.write_bytes(bytes(data))


def _garbage_manifest(tmp: Path, run_dir: Path) -> None:
    (_copy_checkpoint(tmp, run_dir) / "manifest.json").write_text("{'format_version': 1,")


def _future_format(tmp: Path, run_dir: Path) -> None:
    manifest = _copy_checkpoint(tmp, run_dir) / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 99}))


def _mid_epoch(tmp: Path, run_dir: Path) -> None:
    _copy_checkpoint(tmp, run_dir, step=1)


def _model_dir_with_garbage_weights(tmp: Path, run_dir: Path) -> None:
    (tmp / "model").mkdir()
    shutil.copy(run_dir / "model.json", tmp / "model" / "model.json")
    (tmp / "model" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")


def _pickled_state_dict(tmp: Path, run_dir: Path) -> None:
    import torch

    torch.save({"hidden.0.weight": torch.zeros(2, 2), "note": argparse.Namespace(epochs=3)}, tmp / "state.pt")


def _plain_pickle(tmp: Path, run_dir: Path) -> None:
    (tmp / "state.pt").write_bytes(pickle.dumps({"w": fractions.Fraction(1, 3)}))


def resume_case(id: str, setup: Setup, expect: tuple[str, ...], *sets: str, target: str = "{tmp}/ckpt",
                xfail: str | None = None) -> Case:
    argv = ("train", "--quiet", "{tmp}/spec.yaml", "--set", "output={tmp}/out",
            *(arg for value in sets for arg in ("--set", value)), "--resume", target)
    return Case(id, "checkpoint", argv, expect, files={"spec.yaml": TINY_SPEC}, setup=setup, needs_run=True,
                xfail=xfail)


def _nothing(tmp: Path, run_dir: Path) -> None:
    return None


# ----------------------------------------------------------------------------------- the table

CASES: tuple[Case, ...] = (
    # --- spec files ------------------------------------------------------------------------------
    spec_case("spec-yaml-syntax", "model: {name: mlp\nloop: {epochs: 2}\n",
              ("spec.yaml", "cannot parse YAML at line 2", "expected ',' or '}'")),
    spec_case("spec-yaml-tab-indent", "loop:\n\tepochs: 3\n",
              ("spec.yaml", "cannot parse YAML at line 2", "indent with spaces")),
    spec_case("spec-yaml-duplicate-key", "loop: {epochs: 3}\noptimizer: {lr: 0.1}\nloop: {epochs: 5}\n",
              ("spec.yaml", "duplicate key 'loop' at line 3", "each key may appear once")),
    spec_case("spec-not-utf8", b"loop: {epochs: 3}\n# \xff\xfe caf\xe9\n",
              ("spec.yaml", "not UTF-8 text", "save it as UTF-8")),
    spec_case("spec-toml-syntax", "framework = \n", ("spec.toml", "cannot parse TOML", "line 1"), name="spec.toml"),
    spec_case("spec-json-syntax", '{"framework": "torch",}\n', ("spec.json", "cannot parse JSON", "line 1"),
              name="spec.json"),
    spec_case("spec-json-duplicate-key", '{"loop": {"epochs": 2}, "loop": {"epochs": 3}}\n',
              ("spec.json", "duplicate key 'loop'", "each key may appear once"), name="spec.json"),
    spec_case("spec-unknown-key", "optimiser: {name: adam}\n",
              ("optimiser: unknown field", "did you mean 'optimizer'?", "allowed: framework, backend")),
    spec_case("spec-unknown-nested-key", "loop: {epoch: 3}\n",
              ("loop.epoch: unknown field", "did you mean 'epochs'?", "allowed: epochs, max_steps")),
    spec_case("spec-toml-unknown-key", "[optimizer]\nmomentun = 0.9\n",
              ("optimizer.momentun: unknown field", "did you mean 'momentum'?"), name="spec.toml"),
    spec_case("spec-wrong-type-int", 'loop: {epochs: "three"}\n', ("loop.epochs", "expected an integer, got 'three'")),
    spec_case("spec-wrong-type-table", "optimizer: adam\n", ("optimizer", "expected a table of name, lr")),
    spec_case("spec-wrong-type-list", "model: {params: {hidden_sizes: 64}}\n",
              ("model.params.hidden_sizes", "expected a non-empty list of int")),
    spec_case("spec-wrong-type-bool", "optimizer: {nesterov: maybe}\n",
              ("optimizer.nesterov", "expected true or false")),
    spec_case("spec-yaml-exponent-is-text", "optimizer: {lr: 1e-3}\n",
              ("optimizer.lr", "expected a number, got '1e-3'", "write 1.0e-3")),
    spec_case("spec-yaml-exponent-without-sign", "optimizer: {lr: 1.0e8}\n",  # PyYAML needs 1.0e+8 (issue 48)
              ("optimizer.lr", "expected a number, got '1.0e8'", "write 1.0e+8)")),
    spec_case("spec-yaml-exponent-optional-number", "loop: {grad_clip_norm: 1e2}\n",
              ("loop.grad_clip_norm", "got '1e2'", "write 1.0e+2)")),
    spec_case("spec-zero-batch", "data: {batch_size: 0}\n", ("data.batch_size", "must be >= 1")),
    spec_case("spec-negative-lr", "optimizer: {lr: -0.1}\n", ("optimizer.lr", "must be > 0")),
    spec_case("spec-zero-epochs", "loop: {epochs: 0}\n", ("loop.epochs", "must be >= 1")),
    spec_case("spec-negative-hidden-size", "model: {params: {hidden_sizes: [64, -1]}}\n",
              ("model.params", "sizes must be >= 1, got -1")),
    spec_case("spec-unknown-model", "model: {name: resnet50}\n",
              ("model.name", "unknown model 'resnet50'", "allowed: mlp, convnet, transformer")),
    spec_case("spec-unknown-optimizer", "optimizer: {name: lamb}\n",
              ("optimizer.name", "'lamb' is not allowed", "allowed: sgd, adam, adamw")),
    spec_case("spec-unknown-backend", "backend: horovd\n",
              ("backend: 'horovd' is not available", "allowed: auto, local, ddp, fsdp")),
    spec_case("spec-unknown-framework", "framework: jax\n", ("framework", "allowed: torch, tensorflow")),
    spec_case("spec-tensorflow-with-fsdp", "framework: tensorflow\nbackend: fsdp\n",
              ("backend: 'fsdp' is not available for framework 'tensorflow'", "allowed: auto, local")),
    spec_case("spec-precision-not-on-backend", "framework: tensorflow\nbackend: local\nprecision: fp16\n",
              ("precision: 'fp16' is not supported on backend 'local'", "allowed: fp32, bf16")),
    spec_case("spec-transformer-without-tokens", "model: {name: transformer}\n",
              ("model.name", "'transformer' needs data.name 'tokens'")),
    spec_case("spec-fsdp-table-with-ddp", "backend: ddp\nfsdp: {sharding: no_shard}\n",
              ("fsdp: only used with backend 'fsdp'", "not 'ddp'")),
    spec_case("spec-deepspeed-offload-param-stage", "backend: deepspeed\ndeepspeed: {stage: 2, offload_param: true}\n",
              ("deepspeed.offload_param", "needs deepspeed.stage 3")),
    spec_case("spec-deepspeed-nvme-without-path",
              "backend: deepspeed\ndeepspeed: {stage: 3, offload_optimizer: nvme}\n",
              ("deepspeed.nvme_path", "required with deepspeed.offload_optimizer: nvme")),
    # issue 26 item 7: a layout the zoo model cannot take, refused before any process starts
    spec_case("spec-pipeline-stages-beyond-blocks",
              "model: {name: transformer, params: {tie_weights: false}}\ndata: {name: tokens}\nbackend: ddp\n"
              "parallel: {pipeline: 4}\n",
              ("parallel.pipeline", "4 stages need at least 4 blocks", "declares 2 (model.params.n_layers)")),
    spec_case("spec-stage-boundaries-past-last-block",
              "model: {name: transformer, params: {tie_weights: false}}\ndata: {name: tokens}\nbackend: ddp\n"
              "parallel: {pipeline: 2, stage_boundaries: [2]}\n",
              ("parallel.stage_boundaries", "cut past the model's 2 blocks", "each boundary must be below 2")),
    spec_case("spec-tensor-parallel-without-plan", "backend: ddp\nparallel: {tensor: 2}\n",
              ("parallel.tensor", "model 'mlp' has no tensor-parallel plan", "give parallel.tensor_plan")),
    spec_case("spec-npz-without-path", "data: {name: npz}\n", ("data.path", "required when data.name is 'npz'")),
    spec_case("spec-image-size-negative", "data: {name: images, path: ., image_size: [-4, 8]}\n",  # issue 26
              ("data.image_size[0]", "-4 is out of range", "must be 1..16384 pixels")),
    spec_case("spec-feature-is-the-label", "data: {name: csv, path: ., features: [a, y], label: y}\n",
              ("data.features", "'y' is also data.label", "leave it out of data.features")),
    Case("data-csv-nan-feature", "spec", ("train", "--quiet", "{tmp}/spec.yaml", "--set", "output={tmp}/out"),
         ("data.features: row 2 of t.csv has 'nan' in 'a'", "values must be finite numbers"),
         files={"spec.yaml": "backend: local\ndata: {name: csv, path: t.csv, features: [a], label: y, val_fraction: 0, "
                             "workers: 0}\n", "t.csv": "a,y\n1,0\nnan,1\n3,0\n"}),
    Case("data-csv-huge-label", "spec", ("train", "--quiet", "{tmp}/spec.yaml", "--set", "output={tmp}/out"),
         ("data.label: t.csv has label 1099511627776", "without data.classes labels must be below 1048576",
          "set data.classes"),
         files={"spec.yaml": "backend: local\ndata: {name: csv, path: t.csv, features: [a], label: y}\n",
                "t.csv": "a,y\n1,0\n2,1099511627776\n"}),
    spec_case("spec-metrics-same-key", "metrics: ['json:loads', 'pickle:loads']\n",  # issue 26: logs overwrote
              ("metrics[1]", "would be logged as val_loads, like metrics[0] 'json:loads'",
               "give each metric function its own name")),
    Case("spec-npz-path-is-a-npy-array", "spec",  # issue 16 item 9: was a TypeError traceback
         ("train", "--quiet", "{tmp}/spec.yaml", "--set", "output={tmp}/out", "--set", "data.path={tmp}/x.npy"),
         ("data.path", "x.npy is a single .npy array", "arrays named 'x' and 'y'"),
         files={"spec.yaml": "data: {name: npz}\n"}, setup=_npy_file),
    spec_case("spec-top-level-list", "- framework: torch\n",
              ("spec: expected a table at the top level, got list", "spec.yaml must hold fields")),
    spec_case("spec-unsupported-extension", "[job]\nframework = torch\n",
              ("unknown file type", "allowed: .yaml, .yml, .toml, .json"), name="spec.ini"),
    Case("spec-file-missing", "spec", ("train", "{tmp}/nope.yaml"),
         ("spec: cannot read", "nope.yaml", "No such file or directory")),
    # --- --set overrides ---------------------------------------------------------------------------
    set_case("set-without-equals", ("optimizer.lr",), ("--set 'optimizer.lr'", "expected KEY=VALUE")),
    set_case("set-exponent-is-text", ("optimizer.lr=1e8",), ("optimizer.lr", "got '1e8'", "write 1.0e+8)")),
    set_case("set-exponent-without-sign", ("optimizer.lr=1.0e8",), ("optimizer.lr", "got '1.0e8'", "write 1.0e+8)")),
    set_case("set-empty-key", ("=3",), ("--set '=3'", "expected KEY=VALUE")),
    set_case("set-wrong-type", ("loop.epochs=three",), ("loop.epochs", "expected an integer, got 'three'")),
    set_case("set-typo-did-you-mean", ("optimizer.moment=0.9",),
             ("optimizer.moment: unknown field", "did you mean 'momentum'?")),
    set_case("set-zero-accumulation", ("loop.grad_accum_steps=0",), ("loop.grad_accum_steps", "must be >= 1")),
    set_case("set-above-maximum", ("data.val_fraction=0.95",), ("data.val_fraction", "must be <= 0.9")),
    set_case("set-unparsable-value", ("model.params.hidden_sizes=[64,",),
             ("--set model.params.hidden_sizes", "cannot parse value '[64,'", "YAML")),
    set_case("set-into-a-value", ("loop=3", "loop.epochs=2"),
             ("--set loop.epochs", "'loop' is 3, not a table", "has no 'epochs'")),
    set_case("set-unknown-backend", ("backend=nccl",), ("backend: 'nccl' is not available", "allowed: auto, local")),
    set_case("set-preemption-signal", ("preemption.signals=[SIGKILL]",),
             ("preemption.signals[0]", "'SIGKILL' is not a signal a run can handle", "allowed: SIGTERM, SIGUSR1")),
    set_case("set-preemption-grace", ("preemption.grace_s=0",), ("preemption.grace_s", "must be > 0")),
    set_case("set-preemption-requeue", ("preemption.requeue=sometimes",),
             ("preemption.requeue", "'sometimes' is not allowed", "allowed: auto, never, always")),
    Case("set-preemption-requeue-always-outside-slurm", "set",
         ("train", "--quiet", "--set", "output={tmp}/out", "--set", "preemption.requeue=always"),
         ("preemption.requeue: 'always' needs a scheduler that requeues", "no SLURM_JOB_ID", "use 'auto'")),
    # --- command-line flags --------------------------------------------------------------------------
    launch_case("flag-launch-unknown-launcher", ("--launcher", "nosuch", "-np", "2"),
                ("--launcher must be one of", "torchrun, mpirun", "got 'nosuch'")),
    launch_case("flag-launch-np-zero", ("-np", "0"), ("-np must be an integer >= 1", "got '0'")),
    launch_case("flag-launch-requeue-without-a-batch-script", ("--launcher", "torchrun", "-np", "2", "--requeue"),
                ("--requeue goes with --emit-sbatch FILE", "the spec's preemption table handles the signals")),
    launch_case("flag-launch-bad-slurm-signal", ("-np", "2", "--emit-sbatch", "{tmp}/job.sh", "--signal", "KILL@5"),
                ("--signal must be NAME@SECONDS", "USR1", "got 'KILL@5'")),
    launch_case("flag-launch-np-not-a-number", ("-np", "abc"), ("-np must be an integer >= 1", "got 'abc'")),
    launch_case("flag-launch-max-restarts-negative", ("-np", "2", "--max-restarts", "-1"),
                ("--max-restarts must be an integer >= 0", "got '-1'")),
    launch_case("flag-launch-master-port-out-of-range", ("-np", "2", "--master-port", "70000"),
                ("--master-port", "1..65535", "got 70000")),
    launch_case("flag-launch-nnodes-zero", ("-np", "2", "--nnodes", "0"),
                ("--nnodes must be an integer >= 1", "got '0'")),
    launch_case("flag-launch-hostfile-missing", ("-np", "2", "--hostfile", "{tmp}/no-hosts"),
                ("--hostfile", "no-hosts: cannot read it", "No such file")),
    launch_case("flag-launch-hosts-bad-slots", ("-H", "node1:x,node2:2"),
                ("-H 'node1:x'", "slots must be a positive integer, got 'x'")),
    launch_case("flag-launch-hosts-empty", ("-np", "2", "-H", ""), ("-H is empty", "host1:slots,host2:slots")),
    launch_case("flag-launch-hosts-and-hostfile", ("-H", "a:1", "--hostfile", "{tmp}/hosts"),
                ("-H/--hosts or --hostfile", "not both"), files={"hosts": "a slots=1\n"}),
    launch_case("flag-launch-mpi-flavour", ("--launcher", "mpirun", "-np", "2", "--mpi-flavour", "intel"),
                ("--mpi-flavour must be openmpi or hydra", "got 'intel'")),
    launch_case("flag-launch-export-unset-variable", ("-np", "2", "-x", "POLYTRAIN_NO_SUCH_VARIABLE"),
                ("-x POLYTRAIN_NO_SUCH_VARIABLE", "is not set here", "-x POLYTRAIN_NO_SUCH_VARIABLE=VALUE")),
    launch_case("flag-launch-without-target", ("-np", "2"), ("polytrain launch needs a spec", ".yaml", ".py"),
                target=""),
    launch_case("flag-launch-target-not-a-spec", ("-np", "2"), ("launch target", "train.sh", ".yaml", ".py"),
                target="{tmp}/train.sh"),
    Case("flag-launch-bad-spec-fails-once", "flag", ("launch", "-np", "2", "{tmp}/bad.yaml"),
         ("bad.yaml", "cannot parse YAML at line 2"), files={"bad.yaml": "model: {name: mlp\n"}),
    Case("flag-launch-bad-set-fails-once", "flag",
         ("launch", "-np", "2", "{tmp}/ok.yaml", "--set", "optimizer.lr=-1"), ("optimizer.lr", "must be > 0"),
         files=OK_SPEC),
    Case("flag-unknown-subcommand", "flag", ("fit", "spec.yaml"),
         ("invalid choice: 'fit'", "train", "launch", "checkpoint")),
    Case("flag-missing-subcommand", "flag", (), ("required", "train,launch,checkpoint,plot,info")),
    Case("flag-train-unknown-flag", "flag", ("train", "--epochs", "3"),
         ("unrecognized arguments: --epochs", "--set loop.epochs=", "see polytrain train --help")),
    Case("flag-train-timeline-unwritable", "flag", ("train", "--timeline", "{tmp}/file/trace.json"),
         ("--timeline", "file/trace.json", "not a directory"), files={"file": "x"}),
    # issue 16 item 9: os.access says root may write under /proc; it was a traceback at the end of the run
    Case("flag-train-timeline-under-proc", "flag", ("train", "--timeline", "/proc/polytrain-x/trace.json"),
         ("--timeline /proc/polytrain-x/trace.json: cannot write it", "give a path in a writable directory")),
    Case("flag-train-resume-missing", "flag",
         ("train", "--quiet", "{tmp}/spec.yaml", "--set", "output={tmp}/out", "--resume", "{tmp}/nothing"),
         ("--resume", "nothing does not exist", "give a checkpoint directory or 'auto'"),
         files={"spec.yaml": TINY_SPEC}),
    Case("flag-checkpoint-missing-action", "flag", ("checkpoint",), ("required", "inspect,convert,import")),
    Case("flag-checkpoint-convert-to-onnx", "flag", ("checkpoint", "convert", "{tmp}", "--to", "onnx"),
         ("argument --to", "invalid choice: 'onnx'", "safetensors", "torch", "keras")),
    Case("flag-checkpoint-inspect-missing-path", "flag", ("checkpoint", "inspect", "{tmp}/no-such-checkpoint"),
         ("no-such-checkpoint is neither", "(it does not exist)", "give a checkpoint directory")),
    Case("flag-checkpoint-import-without-output", "flag", ("checkpoint", "import", "{tmp}/state.pt"),
         ("required", "-o/--output")),
    Case("flag-checkpoint-import-missing-file", "flag",
         ("checkpoint", "import", "{tmp}/missing.pt", "-o", "{tmp}/out"),
         ("missing.pt does not exist", "DeepSpeed checkpoint directory or a torch state_dict file")),
    Case("flag-plot-missing-run-dir", "flag", ("plot", "{tmp}/no-run", "-o", "{tmp}/p.png"),
         ("plot:", "no-run does not exist", "give the output directory of a run")),
    Case("flag-plot-output-format", "flag", ("plot", "{tmp}/run", "-o", "{tmp}/plot.xyz"),
         ("-o", "plot.xyz", "allowed: ", "png"),
         files={"run/metrics.jsonl": '{"event": "step", "step": 1, "loss": 1.0, "samples_per_s": 9.0}\n'}),
    Case("flag-plot-output-unwritable", "flag", ("plot", "{tmp}/run", "-o", "{tmp}/file/plot.png"),
         ("-o", "file/plot.png", "file is not a directory", "give a path in a writable directory"),
         files={"file": "x", "run/metrics.jsonl": '{"event": "step", "step": 1, "loss": 1.0, "samples_per_s": 9.0}\n'}),
    # --- hostfiles ---------------------------------------------------------------------------------
    hostfile_case("hostfile-slots-not-a-number", "node1 slots=2\nnode2 slots=two\n",
                  ("hosts line 2", "slots must be a positive integer, got 'two'")),
    hostfile_case("hostfile-slots-zero", "node1 slots=0\n", ("hosts line 1", "slots must be a positive integer")),
    hostfile_case("hostfile-unknown-key", "node1 slot=2\n",
                  ("hosts line 1", "unknown field 'slot'", "allowed: slots, max_slots")),
    hostfile_case("hostfile-no-hosts", "# nothing here\n\n", ("names no hosts", "host slots=N")),
    hostfile_case("hostfile-bad-host-name", "node!1 slots=2\n",
                  ("hosts line 1", "bad host name 'node!1'", "letters, digits")),
    hostfile_case("hostfile-max-slots-below-slots", "node1 slots=4 max_slots=2\n",
                  ("hosts line 1", "max_slots=2 is less than slots=4", "max_slots must be >= slots")),
    hostfile_case("hostfile-value-without-key", "node1 4\n",
                  ("hosts line 1", "expected key=value after the host name", "got '4'")),
    # --- launcher environments (torchrun's variables, as a real worker sees them) -----------------------
    env_case("env-rank-not-below-world-size", torchrun_env(RANK="2"),
             ("RANK=2 contradicts WORLD_SIZE=2", "must be in 0..1")),
    env_case("env-rank-not-a-number", torchrun_env(RANK="one"),
             ("RANK='one' is not an integer", "must be an integer >= 0")),
    env_case("env-rank-negative", torchrun_env(RANK="-1"), ("RANK=-1 is below 0", "must be an integer >= 0")),
    env_case("env-world-size-zero", torchrun_env(RANK="0", WORLD_SIZE="0"),
             ("WORLD_SIZE=0 is below 1", "must be an integer >= 1")),
    env_case("env-master-port-out-of-range", torchrun_env(MASTER_PORT="70000"),
             ("MASTER_PORT=70000 is out of range", "1..65535")),
    env_case("env-master-port-missing", torchrun_env(MASTER_PORT=None),
             ("MASTER_PORT is not set", "must export MASTER_ADDR and MASTER_PORT")),
    env_case("env-master-addr-blank", torchrun_env(MASTER_ADDR=" "),
             ("MASTER_ADDR=' ' is not a host", "host name or IP address")),
    env_case("env-local-rank-not-below-local-size", torchrun_env(RANK="2", WORLD_SIZE="4", LOCAL_RANK="2"),
             ("LOCAL_RANK=2 contradicts LOCAL_WORLD_SIZE=2", "must be in 0..1")),
    env_case("env-group-rank-not-below-nodes", torchrun_env(GROUP_RANK="1"),
             ("GROUP_RANK=1 contradicts GROUP_WORLD_SIZE=1", "must be in 0..0")),
    env_case("env-openmpi-rank", load_dump("openmpi5_rank1", OMPI_COMM_WORLD_RANK="x1"),
             ("OMPI_COMM_WORLD_RANK='x1' is not an integer", "must be an integer >= 0")),
    env_case("env-slurm-node-id", load_dump("slurm_srun_rank3", SLURM_NODEID="2"),
             ("SLURM_NODEID=2 contradicts SLURM_STEP_NUM_NODES=2", "must be in 0..1")),
    # --- checkpoints -------------------------------------------------------------------------------
    resume_case("checkpoint-truncated-resume", _truncated,
                ("--resume", "model.safetensors is missing or truncated", "give another checkpoint")),
    resume_case("checkpoint-flipped-bytes-resume", _flipped,
                ("--resume", "model.safetensors is corrupt (sha256 does not match", "give another checkpoint")),
    resume_case("checkpoint-garbage-manifest-resume", _garbage_manifest,
                ("--resume", "manifest.json is unreadable or corrupt", "give another checkpoint")),
    resume_case("checkpoint-future-format-resume", _future_format,
                ("--resume", "format version 99", "this polytrain reads version 1")),
    resume_case("checkpoint-other-model-resume", lambda tmp, run_dir: _copy_checkpoint(tmp, run_dir),
                ("--resume", "different model/data/seed", "resume it with the spec that wrote it"),
                "model.params.hidden_sizes=[16]"),
    resume_case("checkpoint-other-global-batch-mid-epoch-resume", _mid_epoch,
                ("--resume", "stopped mid-epoch with a global batch of 32", "set data.global_batch_size=32"),
                "data.batch_size=16"),
    resume_case("checkpoint-resume-a-file", _nothing,
                ("--resume", "is a file", "give a checkpoint directory"), target="{run}/model.safetensors"),
    resume_case("checkpoint-resume-empty-root", lambda tmp, run_dir: (tmp / "empty").mkdir(),
                ("--resume: no complete checkpoint in", "empty", "'auto'"), target="{tmp}/empty"),
    Case("checkpoint-inspect-not-a-checkpoint", "checkpoint", ("checkpoint", "inspect", "{tmp}/empty"),
         ("empty is neither a polytrain checkpoint nor a model directory", "give a checkpoint directory"),
         files={"empty/notes.txt": "hello\n"}),
    Case("checkpoint-inspect-truncated", "checkpoint", ("checkpoint", "inspect", "{tmp}/ckpt"),
         ("model.safetensors is missing or truncated", "give another checkpoint"), setup=_truncated, needs_run=True),
    Case("checkpoint-convert-garbage-model-dir", "checkpoint",
         ("checkpoint", "convert", "{tmp}/model", "--to", "safetensors", "-o", "{tmp}/w.safetensors"),
         ("model.safetensors", "is not a valid safetensors file", "give a run's output directory"),
         setup=_model_dir_with_garbage_weights, needs_run=True),
    Case("checkpoint-convert-output-unwritable", "checkpoint",
         ("checkpoint", "convert", "{run}", "--to", "safetensors", "-o", "{tmp}/no/such/dir/w.safetensors"),
         ("-o", "w.safetensors", "does not exist"), needs_run=True),
    Case("checkpoint-convert-keras-name", "checkpoint",
         ("checkpoint", "convert", "{run}", "--to", "keras", "-o", "{tmp}/model.keras"),
         ("-o", "model.keras", "must end in .weights.h5"), needs_run=True),
    Case("checkpoint-import-pickle-untrusted", "checkpoint",
         ("checkpoint", "import", "{tmp}/state.pt", "-o", "{tmp}/imported"),
         ("state.pt needs pickle to load", "--trust-checkpoint"), setup=_pickled_state_dict),
    Case("checkpoint-import-plain-pickle-untrusted", "checkpoint",
         ("checkpoint", "import", "{tmp}/state.pt", "-o", "{tmp}/imported"),
         ("state.pt needs pickle to load", "--trust-checkpoint"), setup=_plain_pickle),
    Case("checkpoint-import-not-a-torch-file", "checkpoint",
         ("checkpoint", "import", "{tmp}/state.pt", "-o", "{tmp}/imported"),
         ("state.pt", "is not a torch state_dict file", "DeepSpeed checkpoint directory"),
         files={"state.pt": b"this is not a torch file" * 8}),
)

BY_ID = {case.id: case for case in CASES}


# ----------------------------------------------------------------------------------- running a case


def _launcher_variables() -> set[str]:
    """Every variable some launcher detection reads: the names in all captured dumps, plus torch's."""
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "GROUP_WORLD_SIZE"}
    for dump in DUMPS.glob("*.env"):
        names |= set(load_dump(dump.stem))
    return names - {"PATH", "HOME", "PYTHONPATH", "LD_LIBRARY_PATH"}


LAUNCHER_VARIABLES = _launcher_variables()
LAUNCHER_PREFIXES = ("OMPI_", "PMI", "PMIX_", "SLURM_", "HOROVOD_", "TORCHELASTIC_", "MV2_", "LSB_", "JSM_",
                     "POLYTRAIN_LAUNCHER", "POLYTRAIN_RESTART")


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key in LAUNCHER_VARIABLES or key.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(key)


def _fill(text: str, tmp: Path, run_dir: Path | None) -> str:
    text = text.replace("{tmp}", str(tmp))
    return text.replace("{run}", str(run_dir)) if run_dir is not None else text


def prepare(case: Case, tmp: Path, run_dir: Path | None) -> list[str]:
    """Write the case's files, run its setup; the argv with placeholders filled in."""
    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    if case.setup is not None:
        case.setup(tmp, run_dir if run_dir is not None else tmp)
    return [_fill(arg, tmp, run_dir) for arg in case.argv]


def check_one_line(code: object, err: str, case: Case, tmp: Path) -> str:
    """The shared verdict: exit code 2, one non-empty stderr line with the expected text, no traceback."""
    assert "Traceback" not in err, err
    assert code == 2, f"exit code {code!r}, stderr:\n{err}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"expected one line on stderr, got {len(lines)}:\n{err}"
    line = lines[0]
    for text in case.expect:
        assert _fill(text, tmp, None) in line, f"{text!r} not in: {line}"
    return line


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MLP trained for 2 steps with a checkpoint after each (in-process: the imports are shared)."""
    root = tmp_path_factory.mktemp("trained")
    (root / "spec.yaml").write_text(TINY_SPEC)
    with pytest.MonkeyPatch.context() as mp:
        _clean_env(mp)
        mp.chdir(root)
        code = cli.main(["train", "--quiet", str(root / "spec.yaml"), *TINY_SETS, "--set", f"output={root / 'run'}"])
    assert code == 0
    run_dir = root / "run"
    assert (run_dir / "checkpoints" / "step-00000001" / "manifest.json").is_file()
    assert (run_dir / "checkpoints" / "step-00000002" / "manifest.json").is_file()
    return run_dir


def _params() -> list[object]:
    marks = {case.id: [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else [] for case in CASES}
    return [pytest.param(case, id=case.id, marks=marks[case.id]) for case in CASES]


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_one_line_exit_2(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    run_dir = request.getfixturevalue("trained_run") if case.needs_run else None
    argv = prepare(case, tmp_path, run_dir)
    _clean_env(monkeypatch)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    try:
        code: object = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    line = check_one_line(code, err, case, tmp_path)
    assert line.startswith("polytrain"), line
    assert out == "", f"nothing belongs on stdout, got:\n{out}"


# A few cases per kind of failure, as real processes: nothing but the one line reaches the terminal.
SUBPROCESS_CASES = ("spec-yaml-syntax", "flag-launch-np-zero", "env-rank-not-below-world-size",
                    "checkpoint-truncated-resume")


def _run_cli(case: Case, tmp: Path, run_dir: Path | None, *, debug: bool = False) -> subprocess.CompletedProcess[str]:
    argv = prepare(case, tmp, run_dir)
    env = loopback_env(**case.env)
    if "MASTER_ADDR" not in case.env:  # loopback_env sets it; a launcher variable a case did not ask for
        env.pop("MASTER_ADDR")
    return run([sys.executable, "-m", "polytrain.cli", *(["--debug"] if debug else []), *argv], env=env, cwd=tmp,
               timeout=180)


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
@pytest.mark.slow
def test_real_process_prints_one_line_and_exits_2(case_id: str, tmp_path: Path,
                                                  request: pytest.FixtureRequest) -> None:
    case = BY_ID[case_id]
    run_dir = request.getfixturevalue("trained_run") if case.needs_run else None
    result = _run_cli(case, tmp_path, run_dir)
    check_one_line(result.returncode, result.stderr, case, tmp_path)
    assert result.stderr.startswith("polytrain: error: ")


@pytest.mark.parametrize("case_id", ["spec-yaml-syntax", "env-rank-not-below-world-size"])
def test_debug_shows_the_traceback(case_id: str, tmp_path: Path) -> None:
    case = BY_ID[case_id]
    result = _run_cli(case, tmp_path, None, debug=True)
    assert result.returncode not in (0, 2), result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("polytrain.errors.") and "Error: " in last, last
    for text in case.expect:
        assert _fill(text, tmp_path, None) in last, last


# In-process --debug: the same error object escapes, so the traceback is Python's own.
DEBUG_CASES = ("spec-unknown-key", "set-wrong-type", "flag-launch-unknown-launcher", "hostfile-unknown-key",
               "env-world-size-zero", "checkpoint-inspect-not-a-checkpoint")


@pytest.mark.parametrize("case_id", DEBUG_CASES)
def test_debug_raises_in_process(case_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = BY_ID[case_id]
    argv = prepare(case, tmp_path, None)
    _clean_env(monkeypatch)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as info:
        cli.main(["--debug", *argv])
    assert info.value.exit_code == 2
    for text in case.expect:
        assert _fill(text, tmp_path, None) in str(info.value)


def test_the_table_covers_every_category() -> None:
    counts = Counter(case.category for case in CASES)
    assert set(counts) == set(MINIMUM), counts
    for category, minimum in MINIMUM.items():
        assert counts[category] >= minimum, (category, counts[category])
    assert len(CASES) >= 45 and len(BY_ID) == len(CASES), "ids must be unique"
    for case in CASES:
        assert len(case.expect) >= 2, f"{case.id}: name the field/flag and what is allowed"


@pytest.mark.parametrize("text", ["1e8", "1.0e8", "1E-3", "+2e5", "-.5", "1.e8"])
def test_the_number_hint_writes_what_yaml_reads(text: str) -> None:
    """What the hint says to write loads as that number, in a spec file and through --set (PyYAML both)."""
    import yaml

    from polytrain.spec.files import apply_overrides, parse_text
    from polytrain.spec.schema import number_hint

    hint = number_hint(text)
    assert yaml.safe_load(text) == text and "write " in hint, hint  # PyYAML reads the given form as text
    written = hint.rsplit("write ", 1)[1].rstrip(")")
    assert parse_text(f"optimizer: {{lr: {written}}}\n", ".yaml")["optimizer"]["lr"] == float(text)
    assert apply_overrides({}, [f"optimizer.lr={written}"])["optimizer"]["lr"] == float(text)

