"""``polytrain doctor``'s judgement on given records (the arithmetic of which rank, link or value is named), its bad
input (one line, exit 2, before any rank starts), and one real run of two local ranks that finds nothing. The
named sick link and rank on real hosts: tests/cluster/test_doctor.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.commands.doctor import judge, table

CLI = [sys.executable, "-m", "polytrain.cli", "doctor"]


def record(rank: int, host: str, gemm: float = 10.0, links: dict | None = None, **more: object) -> dict:
    base = {"rank": rank, "host": host, "gemm_gflops": gemm, "links": links or {}, "allreduce_gbs": 1.0,
            "versions": {"torch": "2.13"}, "env": {}, "free_gb": {"/out": 50.0}}
    return {**base, **more}


def link(gbs: float, latency_us: float = 50.0) -> dict:
    return {"gbs": gbs, "latency_us": latency_us}


def ring(*gbs: float, hosts: tuple[str, ...] = ("a", "b", "c", "d")) -> list[dict]:
    n = len(gbs)
    return [record(r, hosts[r], links={str((r + 1) % n): link(g)}) for r, g in enumerate(gbs)]


def test_a_healthy_job_has_no_findings() -> None:
    assert judge(ring(1.0, 1.1, 0.9), 0.5, 1.0, 1.0) == []


def test_the_slow_link_and_the_slow_rank_are_named() -> None:
    records = ring(1.0, 0.01, 1.1, 0.9)
    assert judge(records, 0.5, 1.0, 1.0) == [
        "link rank 1 (b) <-> rank 2 (c): 0.01 GB/s, below 0.5 of the median 0.95 of the links between hosts"]
    records[3]["gemm_gflops"] = 1.0
    found = judge(records, 0.5, 1.0, 1.0)
    assert found[0] == "rank 3 on host d: matrix multiply at 1 GFLOP/s, below 0.5 of the ranks' median 10"
    assert found[1:] == [  # rank 3's links are not judged; the rest still are
        "link rank 1 (b) <-> rank 2 (c): 0.01 GB/s, below 0.5 of the median 0.505 of the links between hosts"]


def test_links_within_a_host_are_compared_only_with_each_other() -> None:
    hosts = ("a", "a", "b", "b")
    records = [record(0, "a", links={"1": link(10.0)}), record(1, "a", links={"2": link(1.0)}),
               record(2, "b", links={"3": link(11.0)}), record(3, "b", links={"0": link(0.9)})]
    assert [r["host"] for r in records] == list(hosts) and judge(records, 0.5, 1.0, 1.0) == []


def test_a_slow_latency_is_named() -> None:
    records = ring(1.0, 1.0, 1.0, 1.0)
    records[1]["links"]["2"] = link(1.0, latency_us=500.0)
    assert judge(records, 0.5, 1.0, 1.0) == [
        "link rank 1 (b) <-> rank 2 (c): latency 500 us, above the median 50 us over 0.5"]


def test_versions_variables_clocks_and_disks_that_differ_are_named() -> None:
    records = ring(1.0, 1.0, 1.0)
    records[1]["versions"] = {"torch": "2.12"}
    records[2]["env"] = {"NCCL_SOCKET_IFNAME": "eth1"}
    records[0]["clock_offsets"] = {"1": {"offset_s": 1.5, "uncertainty_s": 0.6},  # maybe within the bound
                                   "2": {"offset_s": 3.5, "uncertainty_s": 0.01}}
    records[0]["free_gb"] = {"/out": 0.2}
    assert judge(records, 0.5, 1.0, 1.0) == [
        "library torch differs between ranks: '2.13' on ranks 0,2; '2.12' on rank 1",
        "NCCL_SOCKET_IFNAME differs between ranks: None on ranks 0,1; 'eth1' on rank 2",
        "rank 2 on host c: clock +3.500 s (±0.010) from rank 0's, more than 1 s",
        "rank 0 on host a: 0.2 GB free under /out, below 1 GB"]
    assert table(records).splitlines()[3].split()[:3] == ["2", "c", "10"] and "+3.500" in table(records)


@pytest.mark.parametrize(("args", "said"), [
    (["-np", "0"], "polytrain: error: -np: 0; the number of ranks to check, at least 1"),
    (["-np", "2", "-H", "h1:x"], "polytrain: error: -H 'h1:x': slots must be a positive integer"),
    (["-np", "5", "-H", "h1:2,h2:2"], "polytrain: error: -np 5 is more than the 4 slots -H h1:2,h2:2 gives"),
    (["-np", "2", "--launcher", "qsub"], "polytrain: error: --launcher: 'qsub' is not one of"),
    (["-np", "2", "--min-ratio", "1.5"], "polytrain: error: --min-ratio: 1.5; a fraction of the median"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], said: str) -> None:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith(said), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_two_local_ranks_find_nothing_and_write_the_records(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    done = subprocess.run([*CLI, "-np", "2", "--path", str(tmp_path), "--json", str(out)], capture_output=True,
                          text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "polytrain doctor: 2 rank(s): nothing below the bar" in done.stdout
    report = json.loads(out.read_text())
    assert report["findings"] == [] and [r["rank"] for r in report["ranks"]] == [0, 1]
    first = report["ranks"][0]
    assert first["gemm_gflops"] > 0 and first["links"]["1"]["gbs"] > 0 and first["allreduce_gbs"] > 0
    assert first["versions"] == report["ranks"][1]["versions"] and str(tmp_path) in first["free_gb"]
    clock = first["clock_offsets"]["1"]  # one machine, one clock: within the exchange's uncertainty
    assert abs(clock["offset_s"]) <= clock["uncertainty_s"] + 1e-3


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_preflight_runs_the_doctor_before_the_job(tmp_path: Path) -> None:
    """``preflight: true``: `polytrain launch` checks the job's ranks first (its table), then starts the job; a spec
    without it starts the job straight away (its digest is the same: preflight is not part of the training)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"preflight": True, "model": {"name": "mlp", "params": {"hidden_sizes": [8]}},
                                "data": {"name": "synthetic", "batch_size": 16},
                                "loop": {"epochs": 1, "max_steps": 3}, "output": str(tmp_path / "out")}))
    done = subprocess.run([sys.executable, "-m", "polytrain.cli", "launch", "-np", "2", str(spec), "--quiet"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "polytrain launch: preflight: polytrain doctor on the job's 2 rank(s) first" in done.stderr
    table_at, job_at = done.stdout.find("rank  host  GEMM GFLOP/s"), done.stdout.find("nothing below the bar")
    assert 0 <= table_at < job_at, done.stdout
    model = json.loads((tmp_path / "out" / "model.json").read_text())
    assert model["world_size"] == 2

    from polytrain import validation

    with_it = validation.from_dict(json.loads(spec.read_text()), validate_components=False)
    without = validation.from_dict({**json.loads(spec.read_text()), "preflight": False}, validate_components=False)
    assert with_it.preflight and with_it.digest() == without.digest()
