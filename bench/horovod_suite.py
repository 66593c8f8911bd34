"""Horovod's own PyTorch test suite against polytrain's shim: the conformance reference.

Run:  python bench/horovod_suite.py --horovod DIR [--real] [-k EXPR] [--np 2] [--timeout S]

``DIR`` is a checkout of github.com/horovod/horovod (v0.28.1 is the reference) holding
``test/parallel/test_torch.py``. The runner copies that one file into a temporary directory,
rewrites its ``import horovod.torch as hvd`` to ``import polytrain.horovod.torch as hvd``, and
runs it the way Horovod's CI does: ``mpirun -np 2 python -m pytest test_torch.py``, the whole
file in ONE pytest session per rank (a failure that leaves the ranks out of step shows up in the
tests after it). Real Horovod is made unimportable in the ranks (a ``sitecustomize`` placed
first on ``PYTHONPATH`` refuses ``import horovod``), so ``polytrain.horovod.torch`` picks its
shim on its own; every rank records which implementation it ran and the runner checks it.

The suite's helper module ``common`` (``test/utils/common.py``, which imports Horovod's
runner) is replaced by a stand-in of the three helpers ``test_torch.py`` uses; nothing of
Horovod's is copied into this project. ``--real`` runs the unmodified import against the
installed real Horovod instead, for the reference tally.

Each rank appends one JSON line per test phase to a file as it goes (a crash or the timeout
still leaves what ran); a test counts as failed when it failed on any rank, skipped when
skipped on every rank it ran on, passed when it passed on every rank. The tally, then each
failing test with the first line of its error, is printed; ``--json FILE`` writes it too.
Exit status: 0 when the session ran to its end (whatever the tally), 1 when it did not, 2 for
a --horovod directory without the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent
IMPORT_LINE = re.compile(r"^import horovod\.torch as hvd$", re.MULTILINE)

#: refuses ``import horovod`` (and its submodules) in every process that starts with it on PYTHONPATH
SITECUSTOMIZE = '''\
import importlib.abc
import sys


class _NoHorovod(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by bench/horovod_suite.py)", name=name)
        return None


sys.meta_path.insert(0, _NoHorovod())
'''

#: stand-ins for the helpers test_torch.py takes from Horovod's test/utils/common.py
COMMON = '''\
import contextlib
import os
import shutil
import tempfile


def mpi_env_rank_and_size():
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                               ("HOROVOD_RANK", "HOROVOD_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    else:
        test.skipTest(message)


@contextlib.contextmanager
def temppath():
    directory = tempfile.mkdtemp()
    try:
        yield os.path.join(directory, "temp_test_file")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
'''

#: records each test phase as it ends, per rank, and which implementation ran
CONFTEST = '''\
import json
import os

RANK = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
LOG = os.path.join(os.environ["HVD_SUITE_OUT"], f"rank{RANK}.jsonl")


def _write(record):
    with open(LOG, "a") as handle:
        handle.write(json.dumps(record) + "\\n")


def pytest_collection_finish(session):
    import sys

    hvd = sys.modules.get("polytrain.horovod.torch") or sys.modules.get("horovod.torch")
    _write({"impl": getattr(hvd, "IMPL", "horovod") if hvd else None, "collected": len(session.items)})


def pytest_runtest_logreport(report):
    if report.when != "call" and report.outcome == "passed":
        return
    message = ""
    if report.outcome != "passed":
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
            message = str(report.longrepr[2])
    lines = [line for line in message.splitlines() if line.strip()]
    _write({"test": report.nodeid.split("::")[-1], "when": report.when, "outcome": report.outcome,
            "message": lines[0][:300] if lines else ""})


def pytest_sessionfinish(session, exitstatus):
    _write({"finished": int(exitstatus)})
'''


class SuiteInputError(Exception):
    """A bad --horovod directory: reported in one line, exit status 2."""


@dataclass
class Tally:
    """Per-test outcome over all ranks, and what each rank reported about the session."""

    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    impls: dict[int, str | None] = field(default_factory=dict)
    finished: dict[int, int] = field(default_factory=dict)
    collected: int = 0

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)


def prepare(horovod: Path, work: Path, real: bool) -> Path:
    """Copy test_torch.py into ``work`` (the import rewritten unless ``real``) with the helpers; its path."""
    source = horovod / "test" / "parallel" / "test_torch.py"
    if not source.is_file():
        raise SuiteInputError(f"--horovod {horovod}: no test/parallel/test_torch.py there; pass a checkout of "
                              "github.com/horovod/horovod")
    text = source.read_text()
    if not real:
        text, count = IMPORT_LINE.subn("import polytrain.horovod.torch as hvd", text)
        if count != 1:
            raise SuiteInputError(f"--horovod {source}: expected one line 'import horovod.torch as hvd', "
                                  f"found {count}")
    target = work / "test_torch.py"
    target.write_text(text)
    (work / "common.py").write_text(COMMON)
    (work / "conftest.py").write_text(CONFTEST)
    if not real:
        (work / "blocker").mkdir()
        (work / "blocker" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return target


def environment(work: Path, out: Path, real: bool) -> dict[str, str]:
    """Loopback only, one thread per rank, MPI allowed as root; real Horovod hidden unless ``real``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "HOROVOD_", "TORCHELASTIC_", "POLYTRAIN_HOROVOD"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    paths = [str(work)] + ([] if real else [str(work / "blocker")])
    env.update(PYTHONPATH=os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               HVD_SUITE_OUT=str(out), MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
               OMPI_MCA_oob_tcp_if_include="lo", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def command(target: Path, nproc: int, keyword: str | None, test_timeout: float) -> list[str]:
    cmd = [str(BIN / "mpirun"), "--oversubscribe", "--bind-to", "none", "--map-by", "slot", "-np", str(nproc),
           sys.executable, "-m", "pytest", str(target), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(target.parent), f"--timeout={test_timeout:g}", "--timeout-method=signal"]
    return cmd + (["-k", keyword] if keyword else [])


def run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float, log: Path) -> int | None:
    """Run the launch in its own session; on timeout kill the whole session. Its exit code, None on timeout."""
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def collect(out: Path) -> Tally:
    """Merge the ranks' phase records into one outcome per test."""
    tally = Tally()
    by_test: dict[str, list[tuple[int, dict]]] = {}
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "impl" in record:
                tally.impls[rank], tally.collected = record["impl"], max(tally.collected, record["collected"])
            elif "finished" in record:
                tally.finished[rank] = record["finished"]
            else:
                by_test.setdefault(record["test"], []).append((rank, record))
    for test, records in by_test.items():
        failed = [(rank, r) for rank, r in records if r["outcome"] == "failed"]
        ranks_seen = {rank for rank, _ in records}
        if failed:
            rank, first = failed[0]
            tally.outcomes[test] = "failed"
            tally.messages[test] = f"[rank {rank}, {first['when']}] {first['message']}"
        elif all(r["outcome"] == "skipped" for _, r in records):
            tally.outcomes[test] = "skipped"
            tally.messages[test] = records[0][1]["message"]
        elif len(ranks_seen) < len(tally.impls or ranks_seen):
            tally.outcomes[test] = "failed"
            tally.messages[test] = f"reported only by rank(s) {sorted(ranks_seen)}"
        else:
            tally.outcomes[test] = "passed"
    return tally


def report(tally: Tally, exit_code: int | None, expected_impl: str) -> str:
    lines = [f"implementation per rank: {tally.impls}"]
    if any(impl != expected_impl for impl in tally.impls.values()):
        lines.append(f"WARNING: expected every rank to run {expected_impl!r}")
    ran = len(tally.outcomes)
    lines.append(f"collected {tally.collected}, reported {ran}: passed {tally.count('passed')}, "
                 f"failed {tally.count('failed')}, skipped {tally.count('skipped')}")
    if exit_code is None:
        lines.append("the session did not finish: killed at the timeout (tests not reported did not run)")
    elif len(tally.finished) < len(tally.impls):
        lines.append(f"the session did not finish on every rank (mpirun exit {exit_code}); "
                     f"finished on ranks {sorted(tally.finished)}")
    failing = sorted(t for t, o in tally.outcomes.items() if o == "failed")
    if failing:
        lines.append("failed:")
        lines.extend(f"  {test}: {tally.messages[test]}" for test in failing)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horovod", type=Path, required=True, help="a checkout of the horovod repository")
    parser.add_argument("--real", action="store_true", help="run against the installed real Horovod instead")
    parser.add_argument("-k", dest="keyword", help="only the tests pytest -k selects (for quick re-runs)")
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole session")
    parser.add_argument("--test-timeout", type=float, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--json", type=Path, help="also write the per-test outcomes here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (printed)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hvd-suite-"))
    out = work / "out"
    out.mkdir()
    try:
        try:
            target = prepare(args.horovod.resolve(), work, args.real)
        except SuiteInputError as exc:
            print(f"horovod_suite: error: {exc}", file=sys.stderr)
            return 2
        env = environment(work, out, args.real)
        log = work / "mpirun.log"
        exit_code = run(command(target, args.np, args.keyword, args.test_timeout), env, work, args.timeout, log)
        tally = collect(out)
        print(report(tally, exit_code, "horovod" if args.real else "polytrain"))
        if args.json:
            args.json.write_text(json.dumps({"outcomes": tally.outcomes, "messages": tally.messages,
                                             "impls": tally.impls, "exit_code": exit_code}, indent=1))
        if args.keep:
            print(f"kept {work} (mpirun output: {log})")
        return 0 if exit_code is not None and len(tally.finished) == len(tally.impls) > 0 else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
