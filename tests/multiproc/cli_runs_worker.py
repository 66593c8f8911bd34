"""Several ``polytrain train`` command lines in turn in one launched job (test_model_parallel.py): a launch costs
seconds of CPU per rank before it trains (torch, the agent), so one launch per world size runs every command line
of that size, the ones that must fail included.

``python cli_runs_worker.py PLAN_JSON`` — PLAN_JSON is ``{"runs": [{"argv": [...], "env": {NAME: VALUE},
"log": DIR}, ...]}``. Every rank runs ``polytrain.cli.main(argv)`` (what ``polytrain train ...`` runs) for each in
turn, with ``env`` added to its environment for that run, its file descriptors 1 and 2 into ``DIR/rank-R.out``
and ``DIR/rank-R.err`` and the exit code ``main`` returned (the process's under ``polytrain train``) into
``DIR/rank-R.code``. An exception that escapes ``main`` is written there with its traceback, as the process would
have shown it (code 1); a rank that never returns from a run stops the whole launch (the test's timeout).

Under torchrun the worker starts the gloo process group once and every run's backend joins it (a backend only
starts a group when none exists, and only destroys one it started), as resume_worker.py does.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path

# as `polytrain train` sets it before torch is imported: only fatal C++ messages (torch reads it at import)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from polytrain import cli  # noqa: E402
from polytrain.environments import detect_world  # noqa: E402


def run_one(argv: list[str], env: dict[str, str], log: Path, rank: int) -> None:
    log.mkdir(parents=True, exist_ok=True)
    saved_env = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with open(log / f"rank-{rank}.out", "w") as out, open(log / f"rank-{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - what the process would have died of, for the test to show
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    (log / f"rank-{rank}.code").write_text(str(code))


def main(plan_json: str) -> None:
    plan = json.loads(plan_json)
    world = detect_world()
    if world.size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=world.rank, world_size=world.size,
                                timeout=datetime.timedelta(seconds=120))
    try:
        for run in plan["runs"]:
            run_one(run["argv"], run.get("env", {}), Path(run["log"]), world.rank)
    finally:
        if world.size > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    cli.exit_after_training()
