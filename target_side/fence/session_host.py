"""The session host: one shell inside a session's fence, running the session's turns one by one.

This file is handed into the fence from memory (as a script turn's body is)
and run there by the fence's own ``python3``, as the role, under the fence's
filter and limits. Standard library only, and it must stay so: nothing of
paddock exists inside a fence. The server imports it only for the frame
constants and ``encode``.

It keeps one interactive ``bash`` whose controlling terminal is a pty of the
host's own (made in the fence's private ``/dev/pts``), and talks to the
server over its stdin and stdout in frames (a kind byte, a 4-byte big-endian
length, the payload). For each turn it makes FIFOs in a private directory of
the fence's ``/tmp`` and has bash run, in the shell itself,

    PADDOCK_TURN_ID=ID; { . CMDFILE; } <IN >OUT 2>ERR

so that ``cd``, ``export``, functions and background jobs stay for the next
turn (and ``exit`` ends the session). The turn's status never comes from its
output: bash's ``PROMPT_COMMAND`` (read-only) writes ``$?`` to a FIFO of the
host's whenever bash is ready for its next line, which is also what happens
when a list is abandoned after Ctrl-C; a line that bash never finishes
(``{ ...; } ; echo $?``) would lose the status exactly then.

Job control is on, so each job is its own process group and bash hands the
terminal to the one in the foreground: a signal for the turn goes to that
group (``tcgetpgrp``), never to bash, except INT (an interactive bash lives
through it and abandons what it runs). KILL (and the wall-time limit) kills
the foreground group and interrupts bash, so the rest of the turn's list is
abandoned too; a shell that does not come back within ``KILL_GRACE_S`` (a
builtin that ignores INT) is killed, and the session ends, saying why.

A turn on a terminal runs with the session's pty as its stdin, stdout and
stderr; what the pty prints while it runs is the turn's output, its
keystrokes go to the pty (Ctrl-C is the line discipline's to deliver), and a
resize sets the pty's size. Between turns the pty's output is read and
dropped, as is what background processes write to a finished turn's FIFOs:
they are kept open (read and discarded) so such a process neither blocks nor
dies of SIGPIPE, and the next turn is told how many bytes were dropped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import select
import shlex
import signal
import struct
import sys
import tempfile
import termios
import time

HEADER = struct.Struct(">cI")
MAX_PAYLOAD = 8 << 20
"""A frame's payload, at most: a turn's command as JSON (a 1 MiB request, escaped) fits."""
READ_CHUNK = 64 * 1024

# server -> host
RUN = b"R"
"""``{"turn", "source", "stdin": bool, "tty": {"rows", "cols", "term"} | null}``: run a turn."""
INPUT = b"I"
"""Raw bytes for the running turn's stdin (its terminal, for a terminal turn)."""
INPUT_EOF = b"Z"
"""The running turn's stdin ends (a terminal turn is sent ^D)."""
SIGNAL = b"S"
"""``{"turn", "signal": N}``: a signal for the running turn."""
RESIZE = b"W"
"""``{"rows", "cols"}``: the terminal's new size."""

# host -> server
HELLO = b"H"
"""``{"shell", "tty"}``: the shell is ready for its first turn."""
ACCEPTED = b"A"
"""``{"turn", "dropped": N}``: the turn's line went to the shell; N bytes of background output
of earlier turns were dropped since the last turn."""
STDOUT = b"O"
STDERR = b"E"
EXIT = b"X"
"""``{"turn", "status": N}``: the turn's command line is done, with bash's ``$?``."""
NOTE = b"N"
"""``{"turn", "message"}``: something to tell the turn's follower."""
BYE = b"B"
"""``{"status": N | null, "reason"}``: the shell is gone and the session with it."""

KILL_GRACE_S = 3.0
"""After KILL: how long the shell has to come back before the session is ended."""
TTY_SETTLE_S = 0.02
"""After a terminal turn's status: the pty is read until this long passes without output
(what the command wrote just before it ended may still be on its way through the pty)."""
TTY_SETTLE_MAX_S = 0.25
HELLO_TIMEOUT_S = 20.0
DEFAULT_SIZE = (24, 80)


def encode(kind: bytes, payload: bytes | dict[str, object]) -> bytes:
    """One frame: ``kind``, the payload's length, the payload (a dict goes as JSON)."""
    data = json.dumps(payload).encode() if isinstance(payload, dict) else payload
    return HEADER.pack(kind, len(data)) + data


class Turn:
    """The turn the shell is running: its FIFOs, or the terminal."""

    def __init__(self, turn_id: str, directory: str, tty: bool) -> None:
        self.id = turn_id
        self.directory = directory
        self.tty = tty
        self.outputs: dict[int, bytes] = {}
        """Our read end of each output FIFO, and the kind of frame it feeds."""
        self.holders: list[int] = []
        """Our own write ends of the output FIFOs, so they read no end before bash opens them."""
        self.stdin: int | None = None
        self.stdin_path = ""
        self.pending_input = b""
        self.eof_asked = False
        self.kill_deadline: float | None = None


class Host:
    """The shell, its pty, and the turn in it; one loop over every descriptor."""

    def __init__(self, bash: str) -> None:
        self.bash_path = bash
        self.place = tempfile.mkdtemp(prefix=".paddock-session-", dir="/tmp")
        self.status_path = os.path.join(self.place, "status")
        os.mkfifo(self.status_path, 0o600)
        # Read and write: the FIFO never reads end-of-file between two prompts.
        self.status = os.open(self.status_path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.status_buffer = b""
        self.master, slave = os.openpty()
        self.tty_name = os.ttyname(slave)
        os.set_blocking(self.master, False)
        self.resize(*DEFAULT_SIZE)
        commands_read, self.commands = os.pipe()
        self.bash = self._start_bash(commands_read, slave)
        os.close(commands_read)
        os.close(slave)
        self.turn: Turn | None = None
        self.count = 0
        self.late: set[int] = set()
        self.dropped = 0
        self.inbox = b""

    # -- the shell

    def _start_bash(self, commands: int, slave: int) -> int:
        pid = os.fork()
        if pid == 0:  # the child: becomes bash, or dies saying why
            try:
                os.setsid()
                fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
                os.dup2(commands, 0)
                os.dup2(slave, 1)
                os.dup2(slave, 2)
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                # Python ignores these; an ignored signal survives exec.
                for signum in (signal.SIGPIPE, signal.SIGXFSZ):
                    signal.signal(signum, signal.SIG_DFL)
                shell = ["bash", "--norc", "--noprofile", "--noediting", "-i"]
                os.execv(self.bash_path, shell)  # noqa: S606 - the checked bash, no shell between
            except BaseException as exc:  # the child must never return
                with contextlib.suppress(BaseException):
                    os.write(2, f"session host: cannot start bash: {exc}\n".encode())
            os._exit(127)
        return pid

    def prepare_shell(self) -> None:
        """The shell's own settings: no prompt, no history, the status hook (read-only)."""
        hook = f"builtin printf '%s\\n' \"$?\" >{shlex.quote(self.status_path)}"
        self.say_to_shell(
            "PS1=; PS2=; PS0=; unset HISTFILE; set +o history; "
            'export PADDOCK_SESSION_ID="$PADDOCK_TURN_ID"; '
            f"PROMPT_COMMAND={shlex.quote(hook)}; readonly PROMPT_COMMAND"
        )

    def say_to_shell(self, line: str) -> None:
        data = (line + "\n").encode()
        while data:
            data = data[os.write(self.commands, data) :]

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def foreground(self) -> int:
        try:
            return os.tcgetpgrp(self.master)
        except OSError:
            return self.bash

    def shell_group_members(self) -> list[int]:
        """Processes in bash's own process group but bash (a command substitution, say)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in (self.bash, os.getpid()):
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if len(fields) > 2 and int(fields[2]) == self.bash:
                found.append(int(entry))
        return found

    # -- frames to the server

    def send(self, kind: bytes, payload: bytes | dict[str, object]) -> None:
        data = encode(kind, payload)
        while data:
            data = data[os.write(1, data) :]

    # -- turns

    def start_turn(self, message: dict[str, object]) -> None:
        turn_id = str(message["turn"])
        if self.turn is not None:
            self.send(NOTE, {"turn": turn_id, "message": "the session is running another turn"})
            self.send(EXIT, {"turn": turn_id, "status": 125})
            return
        self._forget_stale_statuses()
        self.count += 1
        directory = os.path.join(self.place, str(self.count))
        os.mkdir(directory, 0o700)
        command = os.path.join(directory, "command")
        with open(command, "w", encoding="utf-8") as f:
            f.write(str(message.get("source", "")))
        tty = message.get("tty")
        turn = Turn(turn_id, directory, isinstance(tty, dict))
        q = shlex.quote
        if isinstance(tty, dict):
            self.resize(int(tty["rows"]), int(tty["cols"]))
            term = tty.get("term")
            prefix = f"export TERM={q(str(term))}; " if term else ""
            where = q(self.tty_name)
            redirections = f"<{where} >{where} 2>{where}"
        else:
            prefix = ""
            out, err = self._output_fifo(turn, "stdout"), self._output_fifo(turn, "stderr")
            source = "/dev/null"
            if message.get("stdin"):
                source = os.path.join(directory, "stdin")
                os.mkfifo(source, 0o600)
                # Read and write: the shell's open never waits, and what is sent first is kept.
                turn.stdin = os.open(source, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                turn.stdin_path = source
            redirections = f"<{q(source)} >{q(out)} 2>{q(err)}"
        self.turn = turn
        line = f"PADDOCK_TURN_ID={q(turn_id)}; {{ . {q(command)}; }} {redirections}"
        self.say_to_shell(prefix + line)
        self.send(ACCEPTED, {"turn": turn_id, "dropped": self.dropped})
        self.dropped = 0

    def _output_fifo(self, turn: Turn, kind: str) -> str:
        path = os.path.join(turn.directory, kind)
        os.mkfifo(path, 0o600)
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        turn.holders.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        turn.outputs[reader] = STDOUT if kind == "stdout" else STDERR
        return path

    def _forget_stale_statuses(self) -> None:
        # A prompt the shell printed while idle (an INT that came as a turn ended) is no one's.
        with contextlib.suppress(BlockingIOError):
            while os.read(self.status, 4096):
                pass
        self.status_buffer = b""

    def end_turn(self, status: int) -> None:
        turn = self.turn
        if turn is None:
            return
        for fd, kind in turn.outputs.items():
            self._relay(fd, kind)
        if turn.tty:
            self._settle_terminal()
        for fd in turn.holders:
            os.close(fd)
        # What background processes write here later is read and dropped (see the docstring).
        self.late.update(turn.outputs)
        if turn.stdin is not None:
            os.close(turn.stdin)
        _remove_quietly(turn.directory)
        self.turn = None
        if turn.kill_deadline is not None and status == 128 + signal.SIGINT:
            status = 128 + signal.SIGKILL  # the INT was ours, to abandon what KILL interrupted
        self.send(EXIT, {"turn": turn.id, "status": status})

    def _relay(self, fd: int, kind: bytes) -> bool:
        """Send what ``fd`` holds now; False once it has no writer left."""
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return True
            except OSError as exc:
                if exc.errno == errno.EIO:  # the pty, with nothing on its other side
                    return True
                raise
            if not data:
                return False
            self.send(kind, data)

    def _settle_terminal(self) -> None:
        deadline = time.monotonic() + TTY_SETTLE_MAX_S
        while time.monotonic() < deadline and _readable(self.master, TTY_SETTLE_S):
            try:
                data = os.read(self.master, READ_CHUNK)
            except OSError:
                return
            if not data:
                return
            self.send(STDOUT, data)

    def deliver(self, message: dict[str, object]) -> None:
        turn = self.turn
        if turn is None or message.get("turn") != turn.id:
            return  # a signal for a turn that has ended: nothing to do
        signum = int(str(message["signal"]))
        group = self.foreground()
        if group not in (self.bash, 0):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signum)
            if signum == signal.SIGKILL:
                self._abandon_list(turn)
            return
        # The shell itself is in the foreground: a builtin, or a command substitution.
        if signum == signal.SIGINT:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.bash, signal.SIGINT)  # an interactive bash lives through it
            return
        members = self.shell_group_members()
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if signum == signal.SIGKILL:
            self._abandon_list(turn)
        elif not members:
            name = signal.Signals(signum).name
            self.send(
                NOTE,
                {
                    "turn": turn.id,
                    "message": f"the shell itself runs this command (a builtin), and {name} "
                    "would end the session, so it was not sent; INT interrupts it, KILL ends it",
                },
            )

    def _abandon_list(self, turn: Turn) -> None:
        # INT makes the shell drop the rest of the turn's list once its job is dead.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.bash, signal.SIGINT)
        if turn.kill_deadline is None:
            turn.kill_deadline = time.monotonic() + KILL_GRACE_S

    def take_input(self, data: bytes) -> None:
        turn = self.turn
        if turn is None:
            return
        turn.pending_input += data
        self._push_input(turn)

    def take_eof(self) -> None:
        turn = self.turn
        if turn is None:
            return
        if turn.tty:
            turn.pending_input += b"\x04"
        else:
            turn.eof_asked = True
        self._push_input(turn)

    def _input_fd(self, turn: Turn) -> int | None:
        return self.master if turn.tty else turn.stdin

    def _push_input(self, turn: Turn) -> None:
        fd = self._input_fd(turn)
        if fd is None:
            turn.pending_input = b""
            return
        while turn.pending_input:
            try:
                written = os.write(fd, turn.pending_input)
            except BlockingIOError:
                return
            except OSError:
                turn.pending_input = b""  # nobody reads it any more
                break
            turn.pending_input = turn.pending_input[written:]
        self._end_input(turn)

    def _end_input(self, turn: Turn) -> None:
        """Close our end of the turn's stdin once asked to, and once the shell has opened it.

        Closed before that, the FIFO would lose what it holds, and the shell's open would
        wait for a writer for ever.
        """
        if not turn.eof_asked or turn.pending_input or turn.stdin is None:
            return
        try:
            taken = os.readlink(f"/proc/{self.bash}/fd/0") == turn.stdin_path
        except OSError:
            taken = False
        if taken:
            os.close(turn.stdin)
            turn.stdin = None

    # -- the loop

    def wait_for_shell(self) -> None:
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < deadline:
            ready = _poll([self.status, self.master], [], 0.2)[0]
            if self.master in ready:
                with contextlib.suppress(OSError):
                    os.read(self.master, READ_CHUNK)
            if self.status in ready and self._statuses():
                return
            if self._shell_status() is not None:
                raise SystemExit("session host: bash ended before it was ready")
        raise SystemExit("session host: bash did not become ready")

    def _statuses(self) -> list[int]:
        with contextlib.suppress(BlockingIOError):
            self.status_buffer += os.read(self.status, 4096)
        *lines, self.status_buffer = self.status_buffer.split(b"\n")
        found = []
        for line in lines:
            with contextlib.suppress(ValueError):
                found.append(int(line))
        return found

    def _shell_status(self) -> int | None:
        try:
            pid, status = os.waitpid(self.bash, os.WNOHANG)
        except ChildProcessError:
            return 125
        if pid == 0:
            return None
        return (
            os.waitstatus_to_exitcode(status)
            if os.WIFEXITED(status)
            else (128 + os.WTERMSIG(status))
        )

    def serve(self) -> tuple[int | None, str]:
        """Run turns until the shell or the server is gone; the shell's status and why."""
        while True:
            turn = self.turn
            watched = [0, self.status, self.master, *self.late]
            if turn is not None:
                watched += list(turn.outputs)
            writers = []
            if turn is not None and turn.pending_input:
                writers = [fd for fd in (self._input_fd(turn),) if fd is not None]
            ready, writable = _poll(watched, writers, 0.2)
            if 0 in ready and not self._read_frames():
                return None, "the server closed the session"
            if turn is not None:
                for fd in ready:
                    if fd in turn.outputs:
                        self._relay(fd, turn.outputs[fd])
                if writable:
                    self._push_input(turn)
            if self.master in ready:
                self._read_terminal()
            for fd in [fd for fd in ready if fd in self.late]:
                self._drop_late(fd)
            if self.status in ready:
                for status in self._statuses():
                    self.end_turn(status)
            ended = self._shell_status()
            if ended is not None:
                self.end_turn(ended)
                return ended, f"the shell exited with status {ended}"
            turn = self.turn
            if turn is not None:
                self._end_input(turn)
            if turn is not None and turn.kill_deadline and time.monotonic() > turn.kill_deadline:
                os.kill(self.bash, signal.SIGKILL)
                os.waitpid(self.bash, 0)
                self.end_turn(128 + signal.SIGKILL)
                return None, (
                    "the shell did not come back after its command was killed (a builtin that "
                    "ignores INT?), so the session was ended"
                )

    def _read_terminal(self) -> None:
        try:
            data = os.read(self.master, READ_CHUNK)
        except (BlockingIOError, OSError):
            return
        turn = self.turn
        if turn is not None and turn.tty and data:
            self.send(STDOUT, data)

    def _drop_late(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        if data:
            self.dropped += len(data)
        else:
            self.late.discard(fd)
            os.close(fd)

    def _read_frames(self) -> bool:
        try:
            data = os.read(0, READ_CHUNK)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.inbox += data
        while len(self.inbox) >= HEADER.size:
            kind, size = HEADER.unpack_from(self.inbox)
            if size > MAX_PAYLOAD:
                raise SystemExit(f"session host: a frame of {size} bytes is too large")
            if len(self.inbox) < HEADER.size + size:
                break
            payload = self.inbox[HEADER.size : HEADER.size + size]
            self.inbox = self.inbox[HEADER.size + size :]
            self._handle(kind, payload)
        return True

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == INPUT:
            self.take_input(payload)
        elif kind == INPUT_EOF:
            self.take_eof()
        elif kind in (RUN, SIGNAL, RESIZE):
            message = json.loads(payload)
            if kind == RUN:
                self.start_turn(message)
            elif kind == SIGNAL:
                self.deliver(message)
            else:
                self.resize(int(message["rows"]), int(message["cols"]))


def _remove_quietly(directory: str) -> None:
    """A finished turn's directory: its command file and FIFOs (held ones live on, unnamed)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def _poll(readers: list[int], writers: list[int], timeout: float) -> tuple[set[int], set[int]]:
    """Which of ``readers`` can be read (or hung up) and ``writers`` written, within ``timeout``.

    ``poll``, not ``select``: a descriptor numbered past 1023 is fine.
    """
    poller = select.poll()
    for fd in readers:
        poller.register(fd, select.POLLIN)
    for fd in writers:
        poller.register(fd, select.POLLOUT | (select.POLLIN if fd in readers else 0))
    ready: set[int] = set()
    writable: set[int] = set()
    for fd, events in poller.poll(timeout * 1000):
        if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
            ready.add(fd)
        if events & select.POLLOUT:
            writable.add(fd)
    return ready, writable


def _readable(fd: int, timeout: float) -> bool:
    return fd in _poll([fd], [], timeout)[0]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--bash":
        print("usage: session_host.py --bash PATH", file=sys.stderr)
        return 2
    os.set_blocking(0, False)
    host = Host(argv[1])
    host.prepare_shell()
    host.wait_for_shell()
    host.send(HELLO, {"shell": host.bash, "tty": host.tty_name})
    status, reason = host.serve()
    with contextlib.suppress(OSError):
        host.send(BYE, {"status": status, "reason": reason})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
