"""Which implementation runs the basics and raw collectives: real Horovod or polytrain's shim.

Decided once, at import, by ``polytrain.horovod.common.use_real_horovod`` (``POLYTRAIN_HOROVOD_IMPL``).
Everything else in the package reaches the collectives through ``impl``.
"""

from __future__ import annotations

from polytrain.horovod.common import use_real_horovod

if use_real_horovod("tensorflow"):
    from polytrain.horovod.tensorflow import _real as impl
else:
    from polytrain.horovod.tensorflow import _shim as impl

__all__ = ["impl"]
