"""Tensor parallel in the own-loop API: the ``parallel`` fields a `Distributed` is given, made into the spec's.

``parallel={"tensor": T}`` (or ``spec={"parallel": ...}``; the keyword's fields win) runs the script's model on
the Trainer's model-parallel layout (`polytrain.adapters.torch.parallel.backend`): a ``data × tensor`` mesh,
``ddp`` or ``fsdp`` as the data dimension, made when the `Distributed` starts. ``setup`` splits the model by the
zoo transformer's own plan (a `TransformerLM`, recognised by its class) or by ``tensor_plan``: an import path
``package.module:function`` as in a spec, or the function itself, called as ``function(model, tp_mesh)`` and
returning the ``{submodule name: ParallelStyle}`` plan. The spec names a live function ``fit:<its name>``, as
`polytrain.fit` names a script's objects, and the model ``fit:setup`` (the one given to ``setup``), so the
spec's zoo-model checks do not apply to a model they cannot see.

Pipeline parallel is refused in one line: its schedule runs each micro-batch's forward and backward passes
itself, which a hand-written loop does; it stays with the Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from polytrain.spec.user_code import LIVE_PREFIX
from polytrain.torch.errors import OwnLoopError

PIPELINE = ("parallel.pipeline: pipeline parallel needs a schedule that runs the forward and backward passes "
            "itself, so it stays with the Trainer; use polytrain.fit or a spec (tensor parallel works here)")


def loop_fields(raw: Mapping[str, Any],
                parallel: Mapping[str, Any] | None) -> tuple[dict[str, Any], Callable[..., Any] | None]:
    """The spec's raw fields with ``parallel`` merged into its ``parallel`` table, and the live tensor plan
    taken out of it (None when there is none). Pipeline > 1 is an `OwnLoopError`."""
    out = dict(raw)
    table = {**dict(out.get("parallel") or {}), **dict(parallel or {})}
    pipeline = table.get("pipeline")
    if isinstance(pipeline, int) and pipeline > 1:  # before the spec's checks, which would speak of the model
        raise OwnLoopError(PIPELINE)
    live = table.get("tensor_plan")
    if callable(live):
        table["tensor_plan"] = f"{LIVE_PREFIX}{getattr(live, '__name__', type(live).__name__)}"
    else:
        live = None
    if table:
        out["parallel"] = table
    tensor = table.get("tensor")
    if isinstance(tensor, int) and tensor > 1 and "model" not in out:
        out["model"] = {"name": f"{LIVE_PREFIX}setup"}
    return out, live


def check_loop_layout(spec: Any) -> None:
    """A spec (a file's too) that asks for a pipeline: the one-line refusal."""
    if spec.parallel.pipeline > 1:
        raise OwnLoopError(PIPELINE)
