"""Slurm's compressed host lists and task counts."""

from __future__ import annotations

import pytest

from polytrain.environments.slurm import expand_nodelist, expand_tasks_per_node
from polytrain.errors import EnvironmentDetectionError


@pytest.mark.parametrize(("text", "hosts"), [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("node07", ["node07"]),
    ("host-a,host-b", ["host-a", "host-b"]),
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    ("x[9-11]", ["x9", "x10", "x11"]),
    ("rack1-[1-2]", ["rack1-1", "rack1-2"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("nid[001-002]-ib", ["nid001-ib", "nid002-ib"]),
    ("node[01-02],login[1,3],dgx", ["node01", "node02", "login1", "login3", "dgx"]),
    (" node[1] ", ["node1"]),
])
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-03", "node01-03]", "node[]", "node[3-1]", "node[a-b]", "node[1,,2]",
                                  "a,,b", "", "n[1-2]]x[", "n[[1]]"])
def test_bad_nodelist_names_the_variable(text: str) -> None:
    with pytest.raises(EnvironmentDetectionError, match="^SLURM_STEP_NODELIST=") as info:
        expand_nodelist(text, "SLURM_STEP_NODELIST")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("text", "counts"), [
    ("2(x3),1", [2, 2, 2, 1]),
    ("4", [4]),
    ("1(x2)", [1, 1]),
    ("3,2(x2),8", [3, 2, 2, 8]),
])
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(x", "0", "x2", "2(x0)", "", "2x3", "2(3)", "-1"])
def test_bad_tasks_per_node(text: str) -> None:
    with pytest.raises(EnvironmentDetectionError, match=r"^SLURM_TASKS_PER_NODE=.*expected counts like"):
        expand_tasks_per_node(text)
