"""One manifest builder for every writer (issue 49 item 4): the Trainer's checkpoints and final model and both own
loops' checkpoints record who wrote them and where they stand through `polytrain.checkpoint.record`.

These pin the keys each kind of writer records, which are the format: a key dropped or renamed here is a resume,
an own loop's load or a ``checkpoint inspect`` of checkpoints already written that no longer finds it. (The
Trainer's and the loops' real saves and resumes are tests/train, tests/torch, tests/tensorflow.)
"""

from __future__ import annotations

from polytrain.checkpoint import record
from polytrain.validation import from_dict

#: who wrote it (every manifest and model.json)
IDENTITY = {"polytrain", "run_id", "framework", "backend", "world_size", "versions", "trackers", "model_digest"}
#: where a checkpoint stands
POSITION = {"epoch", "step_in_epoch", "samples_in_epoch", "rng_states", "loss_scaler"}


def test_a_loops_checkpoint_records_who_wrote_it_and_no_spec() -> None:
    writer = record.Writer("torch", "ddp", 2, "run-1", {"wandb": "abc"})
    scaler = {"scale": 1024.0, "_growth_tracker": 3.0}
    manifest = record.manifest(writer, epoch=3, rng_states=[[1], [2]], loss_scaler=scaler, origin=record.ORIGIN,
                               precision="fp16", loop_state={"best": 0.5}, encoded=["loop_state"])
    assert set(manifest) == IDENTITY | POSITION | {"origin", "precision", "loop_state", "encoded"}
    assert (manifest["framework"], manifest["backend"], manifest["world_size"]) == ("torch", "ddp", 2)
    assert (manifest["run_id"], manifest["trackers"], manifest["model_digest"]) == ("run-1", {"wandb": "abc"}, None)
    assert (manifest["epoch"], manifest["step_in_epoch"], manifest["samples_in_epoch"]) == (3, 0, 0)
    assert manifest["loss_scaler"] == scaler and manifest["loss_scaler"] is not scaler
    assert manifest["origin"] == "own-loop" and manifest["loop_state"] == {"best": 0.5}
    assert record.manifest(writer, epoch=0, rng_states=[], loss_scaler=None)["loss_scaler"] is None


def test_the_trainers_records_its_spec_whole() -> None:
    spec = from_dict({"seed": 7})
    writer = record.Writer("torch", "local", 1, "run-2", {}, spec)
    identity = record.identity(writer)
    assert set(identity) == IDENTITY | {"spec", "spec_digest"}
    assert identity["spec_digest"] == spec.digest() and identity["model_digest"] == spec.model_digest()
    assert from_dict(identity["spec"]).digest() == spec.digest()
    manifest = record.manifest(writer, epoch=1, step_in_epoch=2, samples_in_epoch=64, rng_states=[None],
                               loss_scaler=None, global_batch=32)
    assert set(manifest) == IDENTITY | POSITION | {"spec", "spec_digest", "global_batch"}
    assert (manifest["step_in_epoch"], manifest["samples_in_epoch"], manifest["global_batch"]) == (2, 64, 32)
