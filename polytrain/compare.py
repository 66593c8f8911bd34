"""What a loop script run by ``polytrain compare --script`` uses: the backend and number of steps of this run
(`backend`, `steps`) and `Record`, which writes each step's loss and the final weights where compare reads them
(inert outside compare). The command itself is `polytrain.commands.compare`."""

from polytrain.commands.compare_runs import Record, backend, steps

__all__ = ["Record", "backend", "steps"]
