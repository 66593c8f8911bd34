"""Predicted ops (polytrain.horovod.torch.speculate): the metadata exchange is skipped for a repeated small
allreduce, with the same numbers, and a rank that departs from the prediction still gets the mismatch (or the
join) on every rank — over gloo (torchrun) and MPI (mpirun). workers/speculation.py says what each round does."""

import pytest
from hvd_launch import WORKERS, launch, results

pytestmark = pytest.mark.multiproc

ERRORS = {"shape after hits": "CollectiveMismatchError", "another op after hits": "CollectiveMismatchError",
          "optimizer step after hits": "CollectiveMismatchError",
          "allreduce instead of a predicted step": "CollectiveMismatchError", "nothing": "no error"}
#: rounds of each repeated op, and how many of them must have skipped the exchange (the first few teach the
#: history: three agreed ops of context, then the op that followed them)
LEAST_HITS = {"sum": (20, 15), "alternating": (8 * 3, 18), "training loop": (16, 10), "average": (10, 5)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_repeated_allreduces_skip_the_exchange_and_a_departing_rank_still_fails_everywhere(launcher):
    per_rank = results(launch(launcher, 2, WORKERS / "speculation.py", timeout=150))
    assert sorted(per_rank) == [0, 1]
    for rank, data in per_rank.items():
        assert {name: detail for name, detail in data["checks"].items() if detail is not True} == {}, rank
        assert data["errors"] == ERRORS, rank
        for label, (rounds, least) in LEAST_HITS.items():
            hits, misses = data["counts"][label]
            assert least <= hits <= rounds and misses <= 1, (rank, label, hits, misses)
        for departed in ("shape after hits", "another op after hits", "optimizer step after hits",
                         "allreduce instead of a predicted step", "join"):  # each met a prediction, which missed
            assert data["counts"][departed][1] == 1, (rank, departed, data["counts"][departed])
    assert per_rank[0]["counts"] == per_rank[1]["counts"]  # every rank made the same predictions
