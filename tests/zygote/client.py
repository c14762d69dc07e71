"""``python``'s stand-in for the test suite's script runs: hands this process's arguments,
environment, working directory and stdin/stdout/stderr to the pre-imported server
(``server.py``, socket in ``$NEMO_ALIGNER_TEST_ZYGOTE``), forwards the signals it receives to the
forked run and ends as the run ended (its exit code, or killed by the same signal). Anything it
does not handle (other interpreter flags, no server) runs the real interpreter instead.

Run as ``python -S client.py [-u] (SCRIPT | -m MODULE | -c CODE) [ARGS...]``, by ``tests/zygote/python``.
"""

import json
import os
import signal
import socket
import struct
import sys

from server import recv_message  # this file's folder; server.py imports only the standard library at the top

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def parse(argv):
    """``(kind, target, args, unbuffered)`` for the forms the server runs, else None."""
    unbuffered = False
    i = 0
    while i < len(argv) and argv[i] == "-u":
        unbuffered, i = True, i + 1
    if i >= len(argv):
        return None
    if argv[i] in ("-m", "-c"):
        if i + 1 >= len(argv):
            return None
        return ("module" if argv[i] == "-m" else "code"), argv[i + 1], argv[i + 2:], unbuffered
    if argv[i].startswith("-"):
        return None
    return "script", argv[i], argv[i + 1:], unbuffered


def real_python(argv):
    python = os.environ.get("ZYGOTE_REAL_PYTHON") or sys.executable
    os.execv(python, [python, *argv])


def main(argv):
    parsed = parse(argv)
    path = os.environ.get("NEMO_ALIGNER_TEST_ZYGOTE", "")
    if parsed is None or not path:
        real_python(argv)
    kind, target, args, unbuffered = parsed
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:  # a closed stdin/stdout/stderr cannot be passed on
        real_python(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        real_python(argv)
    request = json.dumps({"kind": kind, "target": target, "args": args, "unbuffered": unbuffered,
                          "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    stdio = struct.pack("3i", 0, 1, 2)
    conn.sendmsg([struct.pack("!I", len(request))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, stdio)])
    conn.sendall(request)
    reply = recv_message(conn)
    if reply is None:  # the server refused or died before forking: the real interpreter runs it
        conn.close()
        real_python(argv)
    pid = reply["pid"]

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            reply = recv_message(conn)
            break
        except InterruptedError:
            continue
    if reply is None:  # the server died: its child was killed with it, or is about to be
        return 1
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status) if not os.WIFEXITED(status) else os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
