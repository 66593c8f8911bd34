"""Consolidated, full-precision exports of sharded training runs.

Every polytrain run already ends with ``<output>/model.safetensors``: the backend's
full state (FSDP gathers its shards; DeepSpeed gathers ZeRO's fp32 master weights).
This module also turns a checkpoint written by DeepSpeed itself (``engine.save_checkpoint``,
e.g. with ``deepspeed.save_checkpoint: true``, or by a plain DeepSpeed script) into the
same portable form, in one process, without the ranks that wrote it:

    python -m polytrain.checkpoint.export deepspeed CHECKPOINT_DIR OUTPUT_DIR [--tag TAG] [--trust-checkpoint]

ZeRO stages 1–3 go through ``deepspeed.utils.zero_to_fp32`` (the fp32 master weights,
shards merged, tied weights under both names); DeepSpeed's own loader unpickles their
files, which can run any code, so they are read only with ``--trust-checkpoint``
(``trust=True``): pass it only for checkpoints from a source you trust. A stage-0 checkpoint holds the whole module
already and is read with ``weights_only=True``. The result is ``OUTPUT_DIR/model.safetensors`` and ``model.json``,
readable with `polytrain.checkpoint.store.read_model`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from polytrain.errors import UserError


class ExportError(UserError):
    """A checkpoint that cannot be exported (missing, or not a DeepSpeed checkpoint)."""


def _resolve_tag(checkpoint_dir: Path, tag: str | None) -> str:
    if tag is not None:
        return tag
    latest = checkpoint_dir / "latest"
    if not latest.is_file():
        raise ExportError(f"checkpoint: {checkpoint_dir} has no 'latest' file; pass --tag (one of its step folders)")
    return latest.read_text().strip()


def _step_dir(root: Path, tag: str | None) -> tuple[Path, str]:
    tag = _resolve_tag(root, tag)
    step_dir = root / tag
    if not step_dir.is_dir():
        raise ExportError(f"checkpoint: {step_dir} does not exist (tag {tag!r})")
    return step_dir, tag


def deepspeed_needs_unpickling(checkpoint_dir: str | Path, tag: str | None = None) -> bool:
    """Whether reading this DeepSpeed checkpoint takes DeepSpeed's own loader, which unpickles (ZeRO 1–3)."""
    step_dir, _ = _step_dir(Path(checkpoint_dir), tag)
    return any(step_dir.glob("*optim_states.pt"))


def deepspeed_fp32_state(checkpoint_dir: str | Path, tag: str | None = None,
                         trust: bool = False) -> dict[str, np.ndarray]:
    """The fp32 model weights of a DeepSpeed checkpoint (any ZeRO stage) as name → array.

    ZeRO 1–3 checkpoints need DeepSpeed's unpickling loader: refused unless ``trust``.
    """
    import torch

    root = Path(checkpoint_dir)
    step_dir, tag = _step_dir(root, tag)
    if deepspeed_needs_unpickling(root, tag):
        if not trust:
            raise ExportError(f"checkpoint: {step_dir} needs pickle to load (DeepSpeed's own loader reads ZeRO stage "
                              f"1-3 checkpoints); pass --trust-checkpoint only if you trust its source")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    else:  # ZeRO stage 0: the module is saved whole
        files = sorted(step_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ExportError(f"checkpoint: {step_dir} holds no DeepSpeed model states (mp_rank_*_model_states.pt)")
        try:
            state = torch.load(files[0], map_location="cpu", weights_only=True)["module"]
        except Exception as exc:  # torch raises UnpicklingError and others for disallowed content
            raise ExportError(f"checkpoint: {files[0]} holds more than tensors and plain data; refusing to "
                              f"unpickle it ({type(exc).__name__})") from None
    return {name: tensor.detach().float().cpu().numpy().copy() for name, tensor in state.items()}


def export_deepspeed(checkpoint_dir: str | Path, output_dir: str | Path, tag: str | None = None,
                     trust: bool = False) -> Path:
    """Write ``output_dir/model.safetensors`` (+ ``model.json``) from a DeepSpeed checkpoint; returns the file.

    ``trust``: allow DeepSpeed's unpickling loader (ZeRO 1–3), for checkpoints from a trusted source only.
    """
    from polytrain.checkpoint.store import write_model

    state = deepspeed_fp32_state(checkpoint_dir, tag, trust)
    manifest = {"source": str(Path(checkpoint_dir).resolve()), "format": "deepspeed",
                "tag": _resolve_tag(Path(checkpoint_dir), tag), "dtype": "float32", "tensors": len(state)}
    write_model(Path(output_dir), state, manifest)
    return Path(output_dir) / "model.safetensors"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polytrain.checkpoint.export", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    ds = sub.add_parser("deepspeed", help="a DeepSpeed checkpoint directory (the one holding 'latest')")
    ds.add_argument("checkpoint_dir")
    ds.add_argument("output_dir")
    ds.add_argument("--tag", default=None, help="the step folder to export (default: the one named in 'latest')")
    ds.add_argument("--trust-checkpoint", action="store_true",
                    help="allow unpickling ZeRO 1-3 files (only for checkpoints from a trusted source)")
    args = parser.parse_args(argv)
    try:
        path = export_deepspeed(args.checkpoint_dir, args.output_dir, args.tag, args.trust_checkpoint)
    except UserError as exc:
        print(f"polytrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"exported {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
