"""``polytrain checkpoint inspect|convert|import``: look inside, export plain weights, bring weights in.

- inspect: a table of what a checkpoint (or a final model directory) holds.
- convert ``--to safetensors|torch|keras``: plain single-file model weights for use without polytrain
  (``torch`` = a ``state_dict`` file for ``torch.load(weights_only=True)``; ``keras`` = a
  ``.weights.h5`` of the Keras zoo model, built with the TensorFlow adapter's conventions).
- import: a DeepSpeed ZeRO checkpoint directory (consolidated with ``zero_to_fp32``) or a plain torch
  ``state_dict`` file becomes a polytrain checkpoint that ``polytrain train --resume PATH`` accepts.
  Loading a torch file uses ``weights_only=True``; anything that needs pickle is refused unless
  ``--trust-checkpoint`` is given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polytrain import checkpoint as ckpt
from polytrain.errors import UserError


def _load_any(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """A checkpoint directory, or a final model directory (model.safetensors + model.json)."""
    if (path / "manifest.json").is_file():
        return ckpt.load_checkpoint(path)
    if (path / "model.safetensors").is_file():
        state, manifest = ckpt.read_model(path)
        return manifest, {"model": state}
    if path.is_dir() and (latest := ckpt.find_latest(path)) is not None:
        return ckpt.load_checkpoint(latest)
    raise ckpt.CheckpointError(f"checkpoint: {path} is neither a polytrain checkpoint nor a model directory")


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


def convert(path: Path, to: str, output: Path) -> Path:
    manifest, tensors = _load_any(path)
    model = tensors["model"]
    if to == "safetensors":
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in model.items()}, str(output))
    elif to == "torch":
        import torch

        torch.save({k: torch.from_numpy(np.array(v)) for k, v in model.items()}, output)
    elif to == "keras":
        from polytrain import spec as spec_mod
        from polytrain.adapters.tensorflow.framework import TensorFlowFramework
        from polytrain.adapters.tensorflow.local import LocalBackend
        from polytrain.data import load_dataset
        from polytrain.world import World

        spec = spec_mod.from_dict({**manifest["spec"], "framework": "tensorflow", "backend": "local"})
        fw = TensorFlowFramework(spec, World(), LocalBackend(spec, World()))
        fw.build(load_dataset(spec.data, spec.seed).info)
        fw.load_state(model)
        fw.model.save_weights(str(output))
    else:
        raise UserError(f"--to: {to!r} is not allowed (allowed: safetensors, torch, keras)")
    return output


def _torch_state_dict(path: Path, trust: bool) -> dict[str, np.ndarray]:
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust)
    except Exception as exc:  # torch raises UnpicklingError and others for files that need full pickle
        if trust:
            raise UserError(f"checkpoint import: cannot read {path}: {exc}") from exc
        raise UserError(f"checkpoint import: {path} needs pickle to load; pass --trust-checkpoint only if you "
                        f"trust its source") from exc
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


def _deepspeed_state(path: Path) -> dict[str, np.ndarray]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(path))
    return {_plain_name(k): v.float().numpy() for k, v in state.items()}


def import_weights(source: Path, spec_path: Path | None, overrides: list[str], output: Path,
                   trust: bool = False) -> Path:
    """Write a polytrain checkpoint (step 0, model only) from a DeepSpeed dir or a torch state_dict file."""
    from polytrain import spec as spec_mod

    spec = spec_mod.load(spec_path, overrides)
    if source.is_dir():
        if not (source / "latest").is_file() and not any(source.glob("*/mp_rank_*_model_states.pt")):
            raise UserError(f"checkpoint import: {source} is not a DeepSpeed checkpoint directory "
                            f"(no 'latest' file or global_step*/ folders)")
        state = _deepspeed_state(source)
    else:
        state = _torch_state_dict(source, trust)
    manifest = {"spec": spec.to_dict(), "spec_digest": spec.digest(), "model_digest": spec.model_digest(),
                "framework": spec.framework, "backend": "import", "world_size": 1, "epoch": 0,
                "step_in_epoch": 0, "samples_in_epoch": 0, "global_batch": 0, "rng_states": [],
                "imported_from": str(source)}
    return ckpt.save_checkpoint(output, 0, {"model": state}, manifest)


def describe_json(path: Path) -> str:
    manifest, tensors = _load_any(path)
    shapes = {stem: {k: list(v.shape) for k, v in state.items()} for stem, state in tensors.items()}
    return json.dumps({"manifest": manifest, "tensors": shapes}, indent=2, default=str)
