"""A new launcher is one module and one row: a toy launcher class (defined here, as its module would) added
to `registry.LAUNCHERS` alone is a `polytrain launch --launcher` choice with its `--emit-*` flag, a
`polytrain info` row, dispatched, built, picked a port, given its install hint, and a failed run of the real
toy binary is named from its output with its own traceback held back — nothing else was edited."""

import os
import re
import shlex
import stat
import sys
from pathlib import Path

import pytest

from polytrain import cli
from polytrain.commands import info as info
from polytrain.launchers import LaunchRequest, base, dispatch, registry
from polytrain.launchers.base import BatchScript, CommandLauncher
from polytrain.launchers.failure_report import RankFailure

PY = sys.executable

# The toy launcher binary: starts -n N copies of the program (TOY_RANK set), says which rank failed the way
# real launchers do, and ends with a traceback of its own, as torchrun does.
TOYRUN = f"""#!{PY}
import os, subprocess, sys
args = sys.argv[1:]
n, program = int(args[1]), args[args.index("--") + 1:]
procs = [subprocess.Popen(program, env={{**os.environ, "TOY_RANK": str(rank)}}) for rank in range(n)]
codes = [proc.wait() for proc in procs]
for rank, code in enumerate(codes):
    if code:
        print(f"toyrun: rank {{rank}} on toyhost exited with {{code}}", file=sys.stderr, flush=True)
        raise RuntimeError("toyrun: the job failed")
"""
WORKER = "import os, sys\nsys.exit(3 if os.environ['TOY_RANK'] == '1' else 0)\n"


def parse_toyrun(text: str) -> list[RankFailure]:
    return [RankFailure(int(rank), host, code=int(code))
            for rank, host, code in re.findall(r"^toyrun: rank (\d+) on (\S+) exited with (\d+)$", text, re.MULTILINE)]


class ToyrunLauncher(CommandLauncher):
    name = binary = "toyrun"
    install_hints = {"toyrun": "install toyrun (pip install toyrun)"}
    picks_local_port = True
    failure_parsers = (parse_toyrun,)
    traceback_frames = ("/bin/toyrun",)
    info_binaries = ("toyrun",)
    batch_script = BatchScript("--emit-toy", "write a toy batch script instead of running", "toysub {}")

    def build_command(self, req: LaunchRequest) -> list[str]:
        return ["toyrun", "-n", str(req.nproc), f"--port={req.master_port}", "--", *req.program]

    def emit_script(self, req: LaunchRequest) -> str:
        return "#!/bin/sh\n" + shlex.join(self.build_command(req)) + "\n"


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The one row; the toy binary on PATH. Returns the binary's path."""
    monkeypatch.setattr(registry, "LAUNCHERS", (*registry.LAUNCHERS, ToyrunLauncher))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    binary = bindir / "toyrun"
    binary.write_text(TOYRUN)
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("POLYTRAIN_EXIT_BOARD", raising=False)
    return binary


def launch_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main(["launch", "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_the_row_alone_makes_it_a_launch_choice_with_its_batch_script_flag(capsys, monkeypatch, tmp_path):
    choices = "--launcher LAUNCHER one of torchrun, mpirun, horovodrun, srun, deepspeed, local, ray"
    before = launch_help(capsys)
    assert f"{choices} (default: local)" in before and "--emit-toy" not in before
    monkeypatch.setattr(registry, "LAUNCHERS", (*registry.LAUNCHERS, ToyrunLauncher))
    after = launch_help(capsys)
    assert f"{choices}, toyrun (default: local)" in after
    assert "--emit-toy FILE write a toy batch script instead of running" in after

    script = tmp_path / "job.sh"
    assert cli.main(["launch", "--launcher", "toyrun", "-np", "2", "--master-port", "2000",
                     "--emit-toy", str(script), "w.py"]) == 0
    assert script.read_text() == f"#!/bin/sh\ntoyrun -n 2 --port=2000 -- {PY} w.py\n"
    assert stat.S_IMODE(script.stat().st_mode) == 0o600
    assert f"submit it with: toysub {script}" in capsys.readouterr().err


def test_the_row_alone_gives_dispatch_the_command_port_and_install_hint(monkeypatch):
    monkeypatch.setattr(registry, "LAUNCHERS", (*registry.LAUNCHERS, ToyrunLauncher))
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(base, "port_to_hold", lambda host="", count=1: 40123)
    req = LaunchRequest(launcher="toyrun", nproc=2, program=(PY, "w.py"))
    assert isinstance(dispatch.get_launcher("toyrun"), ToyrunLauncher)
    assert dispatch.with_master_port(req).master_port == 40123
    assert dispatch.build_command(dispatch.with_master_port(req)) == [
        "toyrun", "-n", "2", "--port=40123", "--", PY, "w.py"]
    text = dispatch.describe(dispatch.with_master_port(req))
    assert text.endswith("# note: toyrun not found on PATH: install toyrun (pip install toyrun)")


def test_the_row_alone_gives_polytrain_info_its_binary(toy, monkeypatch):
    monkeypatch.setattr(info, "horovod_build", lambda: None)  # not what this test is about (a slow probe)
    report = info.collect()
    assert list(report["launchers"]) == ["torchrun", "mpirun", "horovodrun", "srun", "deepspeed", "jsrun", "toyrun"]
    assert report["launchers"]["toyrun"] == str(toy)
    assert f"  toyrun       {toy}" in info.to_table(report).splitlines()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("debug", [False, True])
def test_a_failed_toy_run_is_named_from_its_output(toy, tmp_path, capfd, debug):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    code = cli.main(["launch", "--launcher", "toyrun", "-np", "2", *(["--debug"] if debug else []), str(worker)])
    assert code == 1  # toyrun's own exit code (its uncaught error)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("polytrain launch:")]
    assert lines == ["polytrain launch: rank 1 on host toyhost exited with code 3; toyrun exited with code 1"]
    assert "RuntimeError: toyrun: the job failed" in err
    assert ("Traceback" in err and f'File "{toy}"' in err) == debug  # its own traceback only with --debug
