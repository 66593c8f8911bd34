"""``polytrain plan --probe`` across hosts: the probe job runs under ``polytrain launch`` on two hosts of the
cluster (ssh), rank 0 reports the measured links on its standard output, and the plan uses them. h2's link is
capped (htb) at 200 Mbit/s, so the link between the hosts is measured below that cap, whatever the machine, while
the link within a host (loopback) is measured far above it."""

from __future__ import annotations

import json

import pytest
from jobs import launch

from polytrain.plan.comms import wire_factor

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

CAP = 200e6 / 8  # bytes per second: htb's rate on h2's link, each way


def test_probe_measures_the_links_within_and_between_hosts(cluster) -> None:
    h2 = cluster.host("h2")
    h2.rate_limit("200mbit")
    try:
        job = launch(cluster, "plan", "-np", "4", "--nodes", "2", "--probe", "--launcher", "torchrun",
                     "-H", "h1:2,h2:2", "--json").check(180)
    finally:
        h2.netem(None)
    doc = json.loads(job.stdout)
    link = doc["link"]
    assert doc["nodes"] == 2 and doc["world_size"] == 4
    # each byte of the all-reduce between the hosts crossed the capped link: never faster than the cap
    assert 0 < link["inter"] < 1.2 * CAP, link
    assert link["intra"] > 4 * CAP, link  # loopback within a host, not through the cap (~35x it here)
    # the table is computed on the probed link: ddp's predicted communication is its payload over 4 ranks
    # spread across both nodes, on the measured link between them (the link model's arithmetic, no clock)
    ddp = next(row for row in doc["layouts"] if row["layout"] == "ddp")
    assert ddp["comm_payload"] and ddp["comm_seconds"] == pytest.approx(
        sum(wire_factor(kind, 4) * sent / link["inter"] for kind, sent in ddp["comm_payload"].items()), rel=1e-9)
    assert not cluster.leftovers()
