import pytest

from polytrain.errors import LaunchError
from polytrain.launchers.hostfile import (
    parse_hostfile_text,
    parse_hosts_string,
    read_hostfile,
    to_deepspeed_hostfile,
    to_hosts_string,
    to_mpich_hostfile,
    to_openmpi_hostfile,
    to_slurm_nodelist,
)

OPENMPI_FILE = """\
# two GPU nodes and a CPU box
node-a slots=4 max_slots=8
node-b  slots=2   # trailing comment

cpu.box
node-c:3
node-a slots=1
"""


def test_openmpi_hostfile_with_comments_max_slots_bare_and_mpich_lines():
    hosts = parse_hostfile_text(OPENMPI_FILE)
    # node-a appears twice: Open MPI adds the slots up; a bare host has one slot
    assert hosts == [("node-a", 5), ("node-b", 2), ("cpu.box", 1), ("node-c", 3)]


def test_max_dash_slots_spelling_is_accepted():
    assert parse_hostfile_text("h1 slots=2 max-slots=2\n") == [("h1", 2)]


def test_hosts_string_default_slot_and_merge():
    assert parse_hosts_string("h1:2,h2, h3:4") == [("h1", 2), ("h2", 1), ("h3", 4)]
    assert parse_hosts_string("h1:1,h1:2") == [("h1", 3)]


def test_writers_round_trip():
    hosts = [("node-a", 4), ("node-b", 2)]
    assert to_hosts_string(hosts) == "node-a:4,node-b:2"
    assert to_openmpi_hostfile(hosts) == "node-a slots=4\nnode-b slots=2\n"
    assert to_deepspeed_hostfile(hosts) == "node-a slots=4\nnode-b slots=2\n"
    assert to_mpich_hostfile(hosts) == "node-a:4\nnode-b:2\n"
    assert to_slurm_nodelist(hosts) == "node-a,node-b"
    assert parse_hostfile_text(to_openmpi_hostfile(hosts)) == hosts
    assert parse_hostfile_text(to_mpich_hostfile(hosts)) == hosts
    assert parse_hosts_string(to_hosts_string(hosts)) == hosts


@pytest.mark.parametrize(
    "text, message",
    [
        ("h1 slots=2\nh2 slots=two\n", "line 2: slots must be a positive integer, got 'two'"),
        ("h1 slots=0\n", "line 1: slots must be a positive integer, got '0'"),
        ("h1 slots=-3\n", "line 1: slots must be a positive integer, got '-3'"),
        ("# header\nh1 slots=4 max_slots=2\n", "line 2: max_slots=2 is less than slots=4"),
        ("h1 cores=4\n", "line 1: unknown field 'cores' (allowed: slots, max_slots)"),
        ("h1 slots\n", "line 1: expected key=value after the host name, got 'slots'"),
        ("h1 slots=2 slots=3\n", "line 1: slots given twice"),
        ("h1 slots=2\nbad/host slots=1\n", "line 2: bad host name 'bad/host'"),
        ("h1:x\n", "line 1: slots must be a positive integer, got 'x'"),
        ("# nothing but comments\n\n", "names no hosts"),
        ("", "names no hosts"),
    ],
)
def test_bad_hostfiles_name_the_line(text, message):
    with pytest.raises(LaunchError) as info:
        parse_hostfile_text(text, "hostfile hosts.txt")
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("hostfile hosts.txt")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "-H is empty"),
        ("h1:2,,h2", "empty host entry"),
        ("h1:0", "slots must be a positive integer, got '0'"),
        ("h1:2:3", "slots must be a positive integer, got '2:3'"),
        ("h 1:2", "bad host name 'h 1'"),
    ],
)
def test_bad_hosts_strings(text, message):
    with pytest.raises(LaunchError, match="-H") as info:
        parse_hosts_string(text)
    assert message in str(info.value)


def test_read_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=2\n")
    assert read_hostfile(path) == [("a", 2), ("b", 2)]
    with pytest.raises(LaunchError, match=r"--hostfile .*missing: cannot read it"):
        read_hostfile(tmp_path / "missing")
    path.write_text("a slots=2\nb slots=zwei\n")
    with pytest.raises(LaunchError, match=rf"hostfile {path} line 2: slots"):
        read_hostfile(path)
