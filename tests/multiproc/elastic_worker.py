"""A worker for tests/multiproc/test_elastic_driver.py using only `membership`, `reform` and raw torch.distributed.

``python elastic_worker.py LOGDIR STEPS [UNTIL_SIZE]``: an allreduce loop; each step adds the allreduced sum of
ones (the group's size) to a committed total, so the total tells how many steps ran at which size. The
worker whose spawn-time rank is ``ELASTIC_TEST_KILL_RANK`` SIGKILLs itself after ``ELASTIC_TEST_KILL_STEP``
committed steps (its first version only); ``ELASTIC_TEST_FAIL_RANKS`` (comma-separated spawn ranks) exit 3 at
that step instead; spawn rank 0 creates the file ``ELASTIC_TEST_MARK`` then (a test's discovery script reads it). Rank 0 checks the driver's host updates each step and the ranks agree on it in the same
allreduce. With UNTIL_SIZE, the loop also runs until the group has that size. Each (re)formed group and the
end are one JSON line in LOGDIR/<pid>.jsonl.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from polytrain.adapters.torch import reform
from polytrain.comm.membership import JobEnded, Membership


def main() -> int:
    logdir, steps = sys.argv[1], int(sys.argv[2])
    until_size = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    kill_rank = int(os.environ.get("ELASTIC_TEST_KILL_RANK", "-1"))
    fail_ranks = {int(r) for r in os.environ.get("ELASTIC_TEST_FAIL_RANKS", "").split(",") if r}
    kill_step = int(os.environ.get("ELASTIC_TEST_KILL_STEP", "-1"))
    spawn_rank = int(os.environ["HOROVOD_RANK"])
    reform.prepare()
    member = Membership.from_env()
    assignment = member.assignment(member.version)
    state = {"step": 0, "total": 0}
    log = open(os.path.join(logdir, f"{os.getpid()}.jsonl"), "a")

    def record(event: str) -> None:
        log.write(json.dumps({"event": event, "pid": os.getpid(), "spawn_rank": spawn_rank, **state,
                              "version": assignment.version, "rank": dist.get_rank(),
                              "size": dist.get_world_size()}) + "\n")
        log.flush()

    while True:
        try:
            reform.init(member, assignment)  # a member that never came: a peer loss too
            seen = (member.hosts_update() or (0.0, 0))[0]
            box = [state]
            dist.broadcast_object_list(box, src=0)  # the new rank 0's commit wins
            state = dict(box[0])
            record("formed")
            while state["step"] < steps or dist.get_world_size() < until_size:
                if state["step"] == kill_step and assignment.version == member.version:
                    if spawn_rank == kill_rank:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if spawn_rank in fail_ranks:
                        return 3
                    if spawn_rank == 0 and os.environ.get("ELASTIC_TEST_MARK"):
                        open(os.environ["ELASTIC_TEST_MARK"], "w").close()  # the discovery script adds a host
                update = member.hosts_update() if dist.get_rank() == 0 else None
                news = 1.0 if update is not None and update[0] > seen else 0.0
                flags = torch.tensor([1.0, news])
                dist.all_reduce(flags)
                if flags[1] > 0:
                    raise RuntimeError("Connection closed by peer: hosts updated (test)")
                state["step"] += 1
                state["total"] += int(flags[0])
            record("done")
            reform.release()
            return 0
        except RuntimeError as exc:
            if not reform.is_peer_loss(exc):
                raise
        reform.release()
        member.leave(assignment.version)
        try:
            following = member.next(assignment.version)
        except JobEnded as ended:
            return ended.code
        if following is None:
            return 0
        assignment = following


if __name__ == "__main__":
    sys.exit(main())
