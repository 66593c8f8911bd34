"""A launcher's output, passed on by `polytrain launch` as it comes — less the launcher's own traceback.

The stdout and stderr of torchrun, mpirun, srun or deepspeed (their workers' included) are each read in a
thread and written to this process's stdout and stderr unchanged: whole lines as soon as they end, and an
unfinished line (a progress bar redrawn with ``\\r``) as soon as it arrives. Where this process writes to
a terminal the launcher gets a pseudo-terminal (output processing off, the same window size), so the
workers still see a terminal (progress bars, colours); elsewhere a pipe. The last lines are kept, for
`failure_report.parse_launcher_output` to find which rank failed (DeepSpeed logs to stdout, the others
to stderr).

One thing is held back unless ``debug`` (``polytrain launch --debug``): the launcher's own traceback. A
traceback whose first frame (after runpy's) is a launcher's code — a path matching one of ``frames``, the
``traceback_frames`` of the launchers in the registry (the ``torchrun`` script, ``torch/distributed/``,
``deepspeed/launcher/``, ...) — is swallowed; its exception line is passed on, unless
it is torchrun's ``ChildFailedError``, whose framed block of failures is swallowed too: those facts are
what `polytrain launch` then says in one line. A worker's traceback starts in the worker's own code and
is passed on whole; a traceback header that nothing follows within ``hold_seconds`` is passed on too.
"""

from __future__ import annotations

import collections
import fcntl
import os
import re
import select
import termios
import threading
import time
from collections.abc import Callable, Sequence

TRACEBACK = "Traceback (most recent call last):"
_RUNPY_FRAME = re.compile(r'^\s*File "(<frozen runpy>|[^"]*/runpy\.py)"')
HOLD_SECONDS = 1.0
DRAIN_SECONDS = 2.0
KEEP_LINES = 2000
BLOCK_LINES = 500

PASS, HOLD, FRAMES, BLOCK = "pass", "hold", "frames", "block"


def frame_pattern(frames: Sequence[str]) -> re.Pattern[str] | None:
    """A traceback line naming a file whose path matches one of ``frames`` (None: no frames)."""
    if not frames:
        return None
    return re.compile(r'^\s*File "[^"]*(' + "|".join(frames) + ")")


def writer(fd: int) -> Callable[[bytes], None]:
    """A function writing all of its bytes to ``fd`` (nothing, once nobody reads it)."""

    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(fd, view)
            except InterruptedError:
                continue
            except OSError:
                return
            view = view[written:]

    return write


def open_channel(like_fd: int) -> tuple[int, int]:
    """``(read end, the launcher's end)``: a pseudo-terminal when ``like_fd`` is a terminal, else a pipe."""
    if os.isatty(like_fd):
        try:
            reader, child = os.openpty()
            attrs = termios.tcgetattr(child)
            attrs[1] &= ~termios.OPOST  # bytes pass unchanged ("\n" stays "\n")
            termios.tcsetattr(child, termios.TCSANOW, attrs)
            size = fcntl.ioctl(like_fd, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(child, termios.TIOCSWINSZ, size)
            return reader, child
        except OSError:
            pass
    return os.pipe()


class LauncherOutput:
    """One stream of the launcher (``target_fd``: 1 or 2); see the module doc. ``frames``: regexes of paths in
    launchers' own code (`base.OutputReading.frames`).

    ``open()`` makes the channel, starts reading it and returns the end to give the launcher;
    ``finish()`` once the launcher has exited. ``feed``/``tick``/``close`` are the filter alone.
    """

    def __init__(self, target_fd: int = 2, *, debug: bool = False, frames: Sequence[str] = (),
                 write: Callable[[bytes], None] | None = None, hold_seconds: float = HOLD_SECONDS,
                 keep: int = KEEP_LINES) -> None:
        self.target_fd = target_fd
        self.debug = debug
        self._launcher_frame = frame_pattern(frames)
        self.write = write or writer(target_fd)
        self.hold_seconds = hold_seconds
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.state = PASS
        self._pending = b""  # the unfinished line not passed on yet
        self._midline = False  # the start of the current line was passed on: so is the rest of it
        self._held: list[bytes] = []
        self._waiting_since: float | None = None  # since when held lines or a partial line wait
        self._rules = self._block_lines = 0
        self._line_so_far = b""  # what was passed on of the unfinished line, to keep it once it ends
        self._fds: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._ended = threading.Event()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    # ------------------------------------------------------------------ the channel
    def open(self) -> int:
        self._fds = open_channel(self.target_fd)
        self._thread = threading.Thread(target=self._pump, args=(self._fds[0],), daemon=True,
                                        name=f"polytrain-launcher-output-{self.target_fd}")
        self._thread.start()
        return self._fds[1]

    def finish(self) -> str:
        """After the launcher has exited: read what is left (for at most DRAIN_SECONDS, should a stray
        process keep writing), pass on what is held, close the channel, and return the kept lines."""
        self._ended.set()
        if self._thread is not None:
            self._thread.join()
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None
        return self.text

    def _pump(self, fd: int) -> None:
        ended_at: float | None = None
        try:
            while True:
                if self._ended.is_set() and ended_at is None:
                    ended_at = time.monotonic()
                if ended_at is not None and time.monotonic() - ended_at > DRAIN_SECONDS:
                    break
                ready, _, _ = select.select([fd], [], [], 0.1)
                if not ready:
                    if ended_at is not None:
                        break  # the launcher is gone and its output is quiet
                    self.tick()
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self.feed(chunk)
        except OSError:  # a pseudo-terminal reads EIO once no process has it open
            pass
        finally:
            self.close()

    # ------------------------------------------------------------------ the filter
    def feed(self, data: bytes) -> None:
        self._pending += data
        while self._pending:
            newline = self._pending.find(b"\n")
            if self._midline:
                part = self._pending if newline < 0 else self._pending[: newline + 1]
                self._pending = self._pending[len(part):]
                self.write(part)
                self._line_so_far = (self._line_so_far + part)[:1000]
                self._midline = newline < 0
                if not self._midline:
                    self._keep(self._line_so_far)
                    self._line_so_far = b""
                continue
            if newline < 0:
                break
            line, self._pending = self._pending[: newline + 1], self._pending[newline + 1:]
            self._line(line)
        self._pass_partial(force=False)

    def tick(self, now: float | None = None) -> None:
        """Called when the pipe is quiet: pass on what waited longer than ``hold_seconds``."""
        now = time.monotonic() if now is None else now
        if self._waiting_since is not None and now - self._waiting_since >= self.hold_seconds:
            if self.state == HOLD:
                self._release()
            self._pass_partial(force=True)

    def close(self) -> None:
        """End of the stream: pass on held lines and the unfinished last line."""
        if self.state == HOLD:
            self._release()
        if self._line_so_far:
            self._keep(self._line_so_far)
            self._line_so_far = b""
        if self._pending:
            if self.state == PASS:
                self.write(self._pending)
            self._keep(self._pending)
            self._pending = b""

    def _pass_partial(self, force: bool) -> None:
        if not self._pending or self.state != PASS:
            self._waiting_since = self._waiting_since if self.state == HOLD else None
            return
        start = self._pending.decode(errors="replace")
        if not force and not self.debug and TRACEBACK.startswith(start):
            self._waiting_since = self._waiting_since or time.monotonic()
            return  # it may become a traceback header: wait for the rest of the line
        self.write(self._pending)
        self._line_so_far = self._pending[:1000]
        self._pending, self._midline, self._waiting_since = b"", True, None

    def _keep(self, line: bytes) -> str:
        text = line.decode(errors="replace").rstrip("\r\n")
        self.lines.append(text[:1000])
        return text

    def _release(self) -> None:
        for line in self._held:
            self.write(line)
        self._held, self.state, self._waiting_since = [], PASS, None

    def _line(self, line: bytes) -> None:
        text = self._keep(line)
        if self.debug:
            self.write(line)
        elif self.state == PASS:
            if text.startswith(TRACEBACK):
                self._held, self.state, self._waiting_since = [line], HOLD, time.monotonic()
            else:
                self.write(line)
        elif self.state == HOLD:
            self._held.append(line)
            if self._launcher_frame is not None and self._launcher_frame.match(text):
                self._held, self.state, self._waiting_since = [], FRAMES, None
            elif not (_RUNPY_FRAME.match(text) or (text[:1].isspace() and not text.lstrip().startswith("File "))):
                self._release()  # not runpy's frames (or their source lines): the worker's own traceback
        elif self.state == FRAMES:
            if text[:1].isspace() or not text.strip():
                return  # frames, their source lines and markers
            if "ChildFailedError" in text:
                self.state, self._block_lines, self._rules = BLOCK, 0, 0
            else:
                self.state = PASS
                self.write(line)  # the launcher's error, without its frames
        else:  # BLOCK: ends with its second rule of "=" (or, should that never come, after BLOCK_LINES)
            self._block_lines += 1
            self._rules += set(text.strip()) == {"="}
            if self._rules == 2 or self._block_lines >= BLOCK_LINES:
                self.state = PASS
