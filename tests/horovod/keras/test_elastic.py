"""hvd.elastic.KerasState and its callbacks on 2 real ranks, and a restarted job resuming from rank 0's commit.

See worker_elastic.py. The expected semantics are Horovod 0.28.1's (``test_elastic_state`` in its
test_tensorflow2_keras.py) plus polytrain's commits on disk, which hold no pickle.
"""

from __future__ import annotations

import json
import os
import stat
import struct

import pytest

NPROC = 2


def check_train(per_rank: list[dict]) -> None:
    for res in per_rank:
        synced, batch, epoch, note, history = res["synced"]
        # rank 0 built its model at 1.0, rank 1 at 2.0: after sync every rank has rank 0's values
        assert synced["weights"] == [[1.0] * 4, [1.0] * 2]
        assert (batch, epoch, note, history) == (20, 10, "rank0", [0, [0, "x"]])
        assert synced == per_rank[0]["synced"][0]
        # modified, then restored: the synced (saved) values again
        assert res["restored"] == [[[1.0] * 4, [1.0] * 2], 20, 10]
        committed, changed, restored, batch = res["commit_restore"]
        assert changed["weights"] != committed["weights"] and changed["optimizer"] != committed["optimizer"]
        assert changed["sums"] != committed["sums"]
        # exact: weights, Adam's moments and iteration count, the aggregation sums and pass count, counters
        assert restored == committed and batch == 3
        assert committed["sums"][0] == [1.0]  # committed half way through an aggregation cycle
        assert committed["optimizer"][0] == [3.0]

        result, attempts, resets, committed_weights, initialized = res["run"]
        # the first attempt failed with HorovodInternalError after uncommitted changes: rolled back,
        # re-initialised (the reset callback saw the size), synced and run again
        assert result == 3 and resets == [NPROC] and initialized
        assert attempts == [committed_weights, committed_weights]

        seen, batch, epoch, final, restored = res["callbacks"]
        assert seen == [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]  # Horovod's batch/epoch bookkeeping
        assert (batch, epoch) == (0, 2)
        assert restored == final  # the epoch-end commit holds the end of training

        # an uncommittable value: rank 0 cannot write, and every rank raises instead of hanging
        error, total = res["bad_commit"]
        assert error == ("TypeError" if res["rank"] == 0 else "ElasticStateError")
        assert total == float(NPROC)
    assert per_rank[0]["callbacks"][3]["weights"] == per_rank[1]["callbacks"][3]["weights"]


@pytest.mark.multiproc
@pytest.mark.timeout(560)
def test_keras_state_sync_restore_commit_run_and_restart(launch, tmp_path):
    commits = tmp_path / "commits"
    trained = launch.results(launch.mpirun(NPROC, launch.here / "worker_elastic.py", "train", timeout=260,
                                           POLYTRAIN_HOROVOD_ELASTIC_DIR=str(commits)), NPROC)
    assert all(res["impl"] == "polytrain" for res in trained)
    check_train(trained)

    # rank 0 wrote its commits to a private directory, as safetensors with a JSON skeleton
    assert stat.S_IMODE(os.lstat(commits).st_mode) == 0o700
    data = (commits / "state.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert json.loads(data[8:8 + length])["__metadata__"]["format"] == "polytrain.elastic/1"

    # a restarted job: models built with other weights come back to rank 0's last commit on every rank
    resumed = launch.results(launch.mpirun(NPROC, launch.here / "worker_elastic.py", "resume", timeout=260,
                                           POLYTRAIN_HOROVOD_ELASTIC_DIR=str(commits),
                                           POLYTRAIN_RESTART_COUNT="1"), NPROC)
    for res in resumed:
        assert res["resumed"] == trained[0]["persisted"]
