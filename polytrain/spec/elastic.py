"""The ``elastic`` table: training that goes on in place when a rank is lost (issue 51).

``elastic: {min_np, max_np, commit_every_n_steps}``. ``polytrain launch`` reads ``min_np``/``max_np`` as the
defaults of ``--min-np``/``--max-np`` and starts polytrain's elastic driver (`polytrain.launchers.elastic`);
the Trainer keeps a commit of its state in host memory every ``commit_every_n_steps`` optimizer steps and, when a
peer is lost, rolls back to it and goes on at the new world size (`polytrain.train.elastic`).
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.errors import SpecError
from polytrain.spec.schema import rule

#: the backends that recover in place: ddp and horovod (every rank holds the whole state; horovod on polytrain's
#: Horovod implementation only), fsdp (every rank's commit gathers the whole state, which a re-form shards again);
#: what else a backend needs is its contract's `in_place_refusal`, said at start
ELASTIC_BACKENDS = ("auto", "ddp", "horovod", "fsdp")


@dataclass(frozen=True)
class ElasticSpec:
    min_np: int = rule(1, min=1)  # fewest ranks the job goes on with
    max_np: int | None = rule(None, min=1)  # most ranks (None: every slot the driver finds)
    commit_every_n_steps: int = rule(1, min=1)  # optimizer steps between two commits in host memory


def check_elastic(elastic: ElasticSpec, framework: str, backend: str) -> None:
    """The rules of the elastic table across its fields and against the backend (raised as `SpecError`)."""
    if elastic.max_np is not None and elastic.min_np > elastic.max_np:
        raise SpecError(f"elastic.min_np: {elastic.min_np} is more than elastic.max_np {elastic.max_np}: "
                        "the job could never start")
    if framework != "torch":
        raise SpecError(f"elastic: in-place recovery is PyTorch's in this version (framework 'torch', backend "
                        f"{', '.join(ELASTIC_BACKENDS[1:])}), not framework {framework!r}")
    if backend not in ELASTIC_BACKENDS:
        raise SpecError(f"elastic: backend {backend!r} cannot recover in place yet; elastic runs with backend "
                        f"{' or '.join(ELASTIC_BACKENDS)}")
