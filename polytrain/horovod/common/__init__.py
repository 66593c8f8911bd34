"""The neutral core every framework's Horovod API aliases (Horovod's own ``horovod/common``).

Reduce ops with Horovod 0.28.1's values and the rule that picks one (`ops`), the topology
Horovod reports and its row split (`topology`), the ``HOROVOD_*`` settings (`settings`), the
stall warning (`stall`), the live state and topology queries (`basics`), the exceptions
(`errors`) and the choice between the real ``horovod`` package and polytrain's shim
(`switch`, ``POLYTRAIN_HOROVOD_IMPL``). Imports no framework.
"""

from polytrain.horovod.common.basics import NOT_INITIALIZED, Basics
from polytrain.horovod.common.errors import (
    HorovodArgumentError,
    HorovodEnvError,
    HorovodInternalError,
    HorovodUnsupportedError,
    HostsUpdatedInterrupt,
)
from polytrain.horovod.common.ops import (
    REDUCE_OP_NAMES,
    REDUCTIONS,
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    reduce_op_name,
    resolve_average,
)
from polytrain.horovod.common.settings import (
    DEFAULT_CYCLE_TIME_MS,
    DEFAULT_FUSION_THRESHOLD,
    DEFAULT_STALL_CHECK_SECONDS,
    METADATA_CHECK_VARIABLE,
    HorovodSettings,
    MiB,
)
from polytrain.horovod.common.stall import stall_message
from polytrain.horovod.common.switch import (
    HOROVOD_CAPABLE_LAUNCHERS,
    IMPL_CHOICES,
    IMPL_VARIABLE,
    _import_error,
    implementation,
    resolve_names,
    use_real_horovod,
)
from polytrain.horovod.common.topology import Topology, split_rows, topology_from_records, topology_from_world

__all__ = [
    "DEFAULT_CYCLE_TIME_MS", "DEFAULT_FUSION_THRESHOLD", "DEFAULT_STALL_CHECK_SECONDS", "HOROVOD_CAPABLE_LAUNCHERS",
    "IMPL_CHOICES", "IMPL_VARIABLE", "METADATA_CHECK_VARIABLE", "NOT_INITIALIZED", "REDUCE_OP_NAMES", "REDUCTIONS",
    "Adasum", "Average", "Basics", "HorovodArgumentError", "HorovodEnvError", "HorovodInternalError",
    "HorovodSettings", "HorovodUnsupportedError", "HostsUpdatedInterrupt", "Max", "MiB", "Min", "Product", "Sum", "Topology",
    "_import_error", "implementation", "reduce_op_name", "resolve_average", "resolve_names", "split_rows",
    "stall_message", "topology_from_records", "topology_from_world", "use_real_horovod",
]
