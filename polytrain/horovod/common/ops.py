"""Horovod's reduce ops and the rule that picks one from a call's ``op`` and deprecated ``average``."""

from __future__ import annotations

import warnings

from polytrain.horovod.common.errors import HorovodArgumentError

# Horovod 0.28.1's ReduceOp values (``horovod/common/message.h``): scripts compare or serialise them as ints.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
REDUCE_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

#: The reduction that moves each op's data (`polytrain.comm.mpi_transport` names): Average is a sum the
#: caller divides by the number of ranks afterwards; Adasum has none.
REDUCTIONS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "product"}


def reduce_op_name(op: int) -> str:
    if op not in REDUCE_OP_NAMES:
        raise ValueError(f"op={op!r} is not a Horovod reduce op; use one of hvd.Average, hvd.Sum, "
                         "hvd.Min, hvd.Max, hvd.Product")
    return REDUCE_OP_NAMES[op]


def resolve_average(op: int | None, average: bool | None) -> int:
    """Horovod's rule for a collective's reduce op: ``op`` wins; the deprecated ``average`` maps to
    Average or Sum (with a DeprecationWarning); neither means Average. Passing both is an error."""
    if op is not None:
        if average is not None:
            raise HorovodArgumentError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average
