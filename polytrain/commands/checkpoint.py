"""``polytrain checkpoint inspect|convert|import``: look inside, export plain weights, bring weights in.

- inspect: a table of what a checkpoint (or a final model directory) holds.
- convert ``--to safetensors|torch|keras``: plain single-file model weights for use without polytrain
  (``torch`` = a ``state_dict`` file for ``torch.load(weights_only=True)``; ``keras`` = a
  ``.weights.h5`` of the Keras zoo model, built with the TensorFlow adapter's conventions). Building the
  Keras model from the manifest's spec imports no code the manifest names (a checkpoint may come from
  anyone): a model factory there (``model.name: package.module:function``) is refused unless the user names
  it, with their own ``--spec`` or with ``--trust-checkpoint``; the loss, metrics, callbacks and transform
  it names are not needed for the weights and are dropped.
- import: a DeepSpeed ZeRO checkpoint directory (read by `polytrain.checkpoint.export.deepspeed_fp32_state`: the
  step named in its ``latest``, ZeRO-0 with ``weights_only=True``, ZeRO 1-3 consolidated by DeepSpeed's
  ``zero_to_fp32``) or a plain torch ``state_dict`` file becomes a polytrain checkpoint that
  ``polytrain train --resume PATH`` accepts. Loading a torch file uses ``weights_only=True``; anything
  that needs pickle (including DeepSpeed's loader for ZeRO 1-3) is refused unless
  ``--trust-checkpoint`` is given.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polytrain.checkpoint import store as ckpt
from polytrain.errors import UserError
from polytrain.observe import jsonfiles as jsonfiles


def _load_any(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """A checkpoint directory, or a final model directory (model.safetensors + model.json)."""
    if (path / "manifest.json").is_file():
        try:
            return ckpt.load_checkpoint(path)
        except ckpt.CheckpointError as exc:
            raise ckpt.CheckpointError(f"{exc}; give another checkpoint (an earlier step), or the checkpoint root "
                                       f"to take the newest one that verifies") from exc
    if (path / "model.safetensors").is_file() or (path / "model.json").is_file():  # read_model finishes a
        state, manifest = ckpt.read_model(path)  # write that crashed after its commit point (model.json)
        return manifest, {"model": state}
    if path.is_dir() and (latest := ckpt.find_latest(path)) is not None:
        return ckpt.load_checkpoint(latest)
    if path.is_dir() and (damaged := ckpt.complete_checkpoints(path)):
        ckpt.verify(damaged[-1])  # none verifies: say what is wrong with the newest
    missing = "" if path.exists() else " (it does not exist)"
    raise ckpt.CheckpointError(f"checkpoint: {path} is neither a polytrain checkpoint nor a model directory{missing}; "
                               f"give a checkpoint directory (step-NNNNNNNN), a checkpoint root or a run's output "
                               f"directory")


def _check_output(output: Path) -> None:
    """``-o``: its directory must exist (nothing is created on the way)."""
    if not output.parent.is_dir():
        raise UserError(f"-o {output}: directory {output.parent} does not exist; create it or give another path")
    if output.is_dir():
        raise UserError(f"-o {output}: is a directory; give a file name")


def inspect(path: Path) -> str:
    manifest, tensors = _load_any(path)
    lines = [f"checkpoint   {path}"]
    for key in ("framework", "backend", "world_size", "global_step", "epoch", "step_in_epoch", "spec_digest",
                "model_digest", "val_accuracy"):
        if key in manifest:
            lines.append(f"{key:<12} {manifest[key]}")
    for stem, state in tensors.items():
        total = sum(int(np.asarray(a).nbytes) for a in state.values())
        lines += ["", f"{stem}: {len(state)} tensors, {total / 2**20:.2f} MiB",
                  f"  {'name':<40} {'dtype':<8} shape"]
        lines += [f"  {name:<40} {str(arr.dtype):<8} {tuple(arr.shape)}" for name, arr in sorted(state.items())]
    return "\n".join(lines)


#: spec fields that name code and that a model's weights do not depend on: dropped from a manifest's spec
_NOT_FOR_WEIGHTS = ("loss", "metrics", "callbacks", "parallel")


def manifest_code(raw: Mapping[str, Any]) -> list[str]:
    """The fields of a manifest's spec that building its model would import code for, as ``field 'value'``."""
    from polytrain.spec.user_code import is_import_path

    model, data = raw.get("model") or {}, raw.get("data") or {}
    named = [("model.name", model.get("name") if isinstance(model, Mapping) else None),
             ("data.factory", data.get("factory") if isinstance(data, Mapping) else None)]
    return [f"{field} {value!r}" for field, value in named if isinstance(value, str) and is_import_path(value)]


def _keras_spec(path: Path, manifest: Mapping[str, Any], spec_path: Path | None, overrides: Sequence[str],
                trust: bool) -> Any:
    """The spec to build the Keras model from: the user's (``--spec``), else the manifest's without what the
    weights do not need; code that the manifest alone names is imported only with ``trust``."""
    from polytrain import validation
    from polytrain.spec.files import apply_overrides, load_raw

    if spec_path is not None or overrides:
        raw = apply_overrides(load_raw(spec_path) if spec_path else {}, overrides)
    else:
        raw = {k: v for k, v in dict(manifest.get("spec") or {}).items() if k not in _NOT_FOR_WEIGHTS}
        if isinstance(raw.get("data"), Mapping):
            raw["data"] = {k: v for k, v in raw["data"].items() if k != "transform"}
        code = manifest_code(raw)
        if code and not trust:
            raise UserError(f"checkpoint convert: {path}'s manifest names code to build its model ({', '.join(code)}); "
                            f"polytrain does not import code a checkpoint names: give the spec that names it with "
                            f"--spec SPEC, or pass --trust-checkpoint only if you trust the checkpoint's source")
    return validation.from_dict({**raw, "framework": "tensorflow", "backend": "local"})


def convert(path: Path, to: str, output: Path, spec_path: Path | None = None, overrides: Sequence[str] = (),
            trust: bool = False) -> Path:
    """Write ``path``'s model weights as one plain file. ``--to keras`` builds the model from ``spec_path``
    (with ``overrides``) when given, else from the checkpoint's manifest (see `_keras_spec`)."""
    if to == "keras" and not output.name.endswith(".weights.h5"):  # Keras refuses any other name, after the build
        raise UserError(f"-o {output}: --to keras writes Keras weights, whose file name must end in .weights.h5 "
                        f"(load them with model.load_weights)")
    manifest, tensors = _load_any(path)
    model = tensors["model"]
    _check_output(output)
    if to == "safetensors":
        from safetensors.numpy import save

        _write(output, save({k: np.ascontiguousarray(v) for k, v in model.items()}))
    elif to == "torch":
        import io

        import torch

        buffer = io.BytesIO()
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in model.items()}, buffer)
        _write(output, buffer.getvalue())
    elif to == "keras":
        spec = _keras_spec(path, manifest, spec_path, overrides, trust)  # before TensorFlow loads: a refusal is quick
        from polytrain.adapters.tensorflow.framework import TensorFlowFramework
        from polytrain.adapters.tensorflow.local import LocalBackend
        from polytrain.data import load_dataset
        from polytrain.world import World

        fw = TensorFlowFramework(spec, World(), LocalBackend(spec, World()))
        fw.build(load_dataset(spec.data, spec.seed).info)
        fw.load_state(model)
        fw.model.save_weights(str(output))
    else:
        raise UserError(f"--to: {to!r} is not allowed (allowed: safetensors, torch, keras)")
    return output


def _write(output: Path, data: bytes) -> None:
    try:
        output.write_bytes(data)
    except OSError as exc:
        raise UserError(f"-o {output}: cannot write it ({exc.strerror or exc}); give a path in a writable "
                        f"directory") from exc


def _torch_state_dict(path: Path, trust: bool) -> dict[str, np.ndarray]:
    import torch

    if not path.is_file():
        raise UserError(f"checkpoint import: {path} does not exist (give a DeepSpeed checkpoint directory or a "
                        f"torch state_dict file)")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before refusing the file anyway
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=not trust)
    except Exception as exc:  # torch raises UnpicklingError and others for files that need full pickle
        detail = " ".join(str(exc).split())[:200]
        if not trust and "Weights only load failed" in str(exc):
            raise UserError(f"checkpoint import: {path} needs pickle to load; pass --trust-checkpoint only if you "
                            f"trust its source") from exc
        raise UserError(f"checkpoint import: {path} is not a torch state_dict file ({type(exc).__name__}: "
                        f"{detail}); give a DeepSpeed checkpoint directory or a file written by torch.save") from exc
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(torch.is_tensor(v) for v in obj.values()):
        raise UserError(f"checkpoint import: {path} does not hold a state_dict of tensors")
    return {_plain_name(k): v.detach().float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in obj.items()}


def _plain_name(name: str) -> str:
    """Strip wrapper prefixes (DDP's ``module.``, FSDP1's ``_fsdp_wrapped_module.``, compile's ``_orig_mod.``)."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _deepspeed_state(path: Path, trust: bool, tag: str | None) -> dict[str, np.ndarray]:
    """The fp32 weights of a DeepSpeed checkpoint directory, through `polytrain.checkpoint.export` (every ZeRO stage)."""
    from polytrain.checkpoint.export import deepspeed_fp32_state, deepspeed_needs_unpickling

    if not trust and deepspeed_needs_unpickling(path, tag):
        raise UserError(f"checkpoint import: {path} needs pickle to load (DeepSpeed's own loader reads ZeRO stage "
                        f"1-3 checkpoints); pass --trust-checkpoint only if you trust its source")
    return {_plain_name(k): v for k, v in deepspeed_fp32_state(path, tag, trust).items()}


def import_weights(source: Path, spec_path: Path | None, overrides: list[str], output: Path,
                   trust: bool = False, tag: str | None = None) -> Path:
    """Write a polytrain checkpoint (step 0, model only) from a DeepSpeed dir or a torch state_dict file.

    ``tag``: the DeepSpeed step folder to read (default: the one its ``latest`` file names)."""
    from polytrain import validation

    spec = validation.load(spec_path, overrides)
    if source.is_dir():
        if not (source / "latest").is_file() and not any(source.glob("*/mp_rank_*_model_states.pt")):
            raise UserError(f"checkpoint import: {source} is not a DeepSpeed checkpoint directory "
                            f"(no 'latest' file or global_step*/ folders)")
        state = _deepspeed_state(source, trust, tag)
    else:
        state = _torch_state_dict(source, trust)
    manifest = {"spec": spec.to_dict(), "spec_digest": spec.digest(), "model_digest": spec.model_digest(),
                "framework": spec.framework, "backend": "import", "world_size": 1, "epoch": 0,
                "step_in_epoch": 0, "samples_in_epoch": 0, "global_batch": 0, "rng_states": [],
                "imported_from": str(source)}
    try:
        return ckpt.save_checkpoint(output, 0, {"model": state}, manifest)
    except OSError as exc:
        raise UserError(f"-o {output}: cannot write the checkpoint there ({exc.strerror or exc}); give a "
                        f"directory that can be created or written") from exc


def describe_json(path: Path) -> str:
    manifest, tensors = _load_any(path)
    shapes = {stem: {k: list(v.shape) for k, v in state.items()} for stem, state in tensors.items()}
    return jsonfiles.dumps({"manifest": manifest, "tensors": shapes}, indent=2, default=str)
