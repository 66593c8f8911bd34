"""The launcher's output passed through `polytrain launch`: everything unchanged and at once, except the
launcher's own traceback (held back unless --debug); and the real channel (pipe) end to end."""

import subprocess
import sys

from polytrain.launchers import registry
from polytrain.launchers.launcher_output import LauncherOutput as _LauncherOutput


def LauncherOutput(*args, **kwargs) -> _LauncherOutput:  # noqa: N802 - the class as `polytrain launch` makes it
    """With the traceback frames of every registered launcher, as `polytrain launch` reads any launcher's output."""
    return _LauncherOutput(*args, frames=registry.output_reading().frames, **kwargs)

TORCHRUN_TRACEBACK = b"""\
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
/tmp/kill1.py FAILED
-------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  host      : vm
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 14703)  (SIGKILL)
=======================================================
"""

WORKER_TRACEBACK = b"""\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/work/train.py", line 3, in <module>
    raise ValueError("boom on rank 1")
ValueError: boom on rank 1
"""


def filtered(*chunks: bytes, debug: bool = False) -> tuple[bytes, LauncherOutput]:
    written: list[bytes] = []
    output = LauncherOutput(debug=debug, write=written.append)
    for chunk in chunks:
        output.feed(chunk)
    output.close()
    return b"".join(written), output


def test_the_launchers_traceback_and_failure_block_are_held_back_and_kept_for_the_report():
    before, after = b"E1125 api.py:1002] failed (exitcode: -9) local_rank: 1\n", b"a later line\n"
    out, output = filtered(before + TORCHRUN_TRACEBACK + after)
    assert out == before + after
    assert "rank      : 1 (local_rank: 1)" in output.text and "ChildFailedError" in output.text


def test_debug_passes_the_traceback_on_whole():
    out, _ = filtered(TORCHRUN_TRACEBACK, debug=True)
    assert out == TORCHRUN_TRACEBACK


def test_a_workers_traceback_passes_even_split_across_reads():
    text = b"rank 1 starting\n" + WORKER_TRACEBACK
    out, _ = filtered(*(text[i:i + 7] for i in range(0, len(text), 7)))
    assert out == text


def test_another_launcher_error_is_condensed_to_its_exception_line():
    text = (b"Traceback (most recent call last):\n  File \"/venv/bin/torchrun\", line 8, in <module>\n"
            b"    sys.exit(main())\ntorch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: timed out\n"
            b"next\n")
    out, _ = filtered(text)
    assert out == b"torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: timed out\nnext\n"


def test_an_unfinished_line_is_passed_on_at_once_unless_it_may_be_a_traceback_header():
    written: list[bytes] = []
    output = LauncherOutput(write=written.append)
    output.feed(b"epoch 1:  50%|#####     |\r")
    assert written == [b"epoch 1:  50%|#####     |\r"]  # a progress bar is not held until a newline
    output.feed(b"epoch 1: 100%|##########|\n")
    assert b"".join(written) == b"epoch 1:  50%|#####     |\repoch 1: 100%|##########|\n"
    written.clear()
    output.feed(b"Trace")
    assert written == []  # may be a traceback header: wait for the line
    output.tick(now=float("inf"))  # nothing came for longer than hold_seconds
    assert written == [b"Trace"]


def test_a_lone_traceback_header_is_released_after_the_hold():
    written: list[bytes] = []
    output = LauncherOutput(write=written.append)
    output.feed(b"Traceback (most recent call last):\n")
    assert written == []
    output.tick(now=float("inf"))
    assert written == [b"Traceback (most recent call last):\n"]


def test_through_a_real_pipe(capfd):
    output = LauncherOutput(2)
    child_end = output.open()  # capfd's stderr is no terminal: a pipe
    script = (f"import sys; sys.stderr.buffer.write({TORCHRUN_TRACEBACK!r}); sys.stderr.write('worker line\\n'); "
              f"sys.stdout.write('not here\\n')")
    subprocess.run([sys.executable, "-c", script], stderr=child_end, check=True, timeout=60)
    text = output.finish()
    err = capfd.readouterr().err
    assert err == "worker line\n"
    assert "ChildFailedError" in text and "worker line" in text
