"""The implementation ``polytrain.horovod.tensorflow`` runs: real Horovod's (`_real`) or polytrain's (`_shim`).

Chosen once, at import, by ``polytrain.horovod.common.use_real_horovod`` (``POLYTRAIN_HOROVOD_IMPL``).
Both modules export the same names (their ``__all__``); this module holds the chosen one's.
"""

from polytrain.horovod.common import use_real_horovod

if use_real_horovod("tensorflow"):
    from polytrain.horovod.tensorflow._real import *  # noqa: F403
else:
    from polytrain.horovod.tensorflow._shim import *  # noqa: F403
