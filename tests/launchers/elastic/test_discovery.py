"""Discovery output parsing (Horovod's HOST[:SLOTS] lines) and running a script, bounded."""

import os
import stat

import pytest

from polytrain.launchers.elastic.discovery import DiscoveryError, ScriptDiscovery, parse_output


def test_lines_with_and_without_slots():
    assert parse_output("localhost:2\n127.0.0.1:2\n", None, "s") == {"localhost": 2, "127.0.0.1": 2}
    assert parse_output("\n  host-a \nhost_b.example:3\n\n", 4, "s") == {"host-a": 4, "host_b.example": 3}
    assert parse_output("a\n", None, "s") == {"a": 1}  # no --slots-per-host: one slot
    assert parse_output("", None, "s") == {}


@pytest.mark.parametrize("line", ["a:b", "a:0", "a:-1", ":2", "host name:2", "a:2:3x", "a;rm:1", "a:١"])
def test_malformed_line_is_named(line):
    with pytest.raises(DiscoveryError, match="printed a malformed line " + repr(line).replace("\\", "\\\\")):
        parse_output(f"ok:1\n{line}\n", None, "--host-discovery-script s")


def _script(tmp_path, body, mode=0o755):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    os.chmod(path, mode)
    return str(path)


def test_script_runs_each_time(tmp_path):
    counter = tmp_path / "n"
    script = _script(tmp_path, f'echo x >> {counter}; echo "localhost:$(wc -l < {counter})"')
    discovery = ScriptDiscovery(script, timeout_s=10)
    assert discovery.find() == {"localhost": 1}
    assert discovery.find() == {"localhost": 2}


def test_script_problems(tmp_path):
    with pytest.raises(DiscoveryError, match="no such file"):
        ScriptDiscovery(str(tmp_path / "missing"), timeout_s=5).find()
    with pytest.raises(DiscoveryError, match=r"not an executable file \(chmod \+x it\)"):
        ScriptDiscovery(_script(tmp_path, "echo a:1", stat.S_IRUSR | stat.S_IWUSR), timeout_s=5).find()
    with pytest.raises(DiscoveryError, match="failed with exit code 3: no hosts today"):
        ScriptDiscovery(_script(tmp_path, "echo no hosts today >&2; exit 3"), timeout_s=5).find()
    with pytest.raises(DiscoveryError, match="ran longer than 0.5 s"):
        ScriptDiscovery(_script(tmp_path, "sleep 30"), timeout_s=0.5).find()
