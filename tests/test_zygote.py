"""The pre-imported interpreter the tests' script runs start from (``tests/zygote/``): a run through it
looks to the test as a ``python`` run does (arguments, paths, environment, output, exit status,
signals, threads), and one whose client is killed dies with it."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import _zygote, subprocess_env, zygote_env

# what a fork inherits from torch's and megatron-core's imports changes between their releases
pytestmark = pytest.mark.stack

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, tempfile, time
    import torch
    mode = sys.argv[1]
    if mode == "describe":
        print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "file": __file__, "cwd": os.getcwd(),
                          "var": os.environ.get("ZYGOTE_TEST_VAR"), "name": __name__, "tmp": tempfile.gettempdir(),
                          "threads": torch.get_num_threads(), "stdin": sys.stdin.read()}))
        print("to stderr", file=sys.stderr)
    elif mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "raise":
        raise ValueError("bad value")
    elif mode == "term":
        signal.signal(signal.SIGTERM, lambda *_: (print("stopping", flush=True), sys.exit(0)))
        print(os.getpid(), flush=True)
        time.sleep(60)
    elif mode == "sleep":
        print(os.getpid(), flush=True)
        time.sleep(60)
""")


@pytest.fixture
def through(zygote):
    if not zygote:
        why = _zygote.get("why_not") or "NEMO_ALIGNER_TEST_ZYGOTE=0"
        pytest.skip(f"no pre-imported interpreter in this process: {why}")
    return zygote_env(subprocess_env())


def run_both(through, tmp_path, args, **kwargs):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    shim, env = through
    results = []
    for python, run_env in ((sys.executable, subprocess_env()), (shim, env)):
        run_env = dict(run_env, ZYGOTE_TEST_VAR="value", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
        results.append(subprocess.run([python, str(script), *args], env=run_env, capture_output=True, text=True,
                                      timeout=120, cwd=tmp_path, **kwargs))
    return results


def test_a_run_sees_what_python_gives_it(through, tmp_path):
    real, forked = run_both(through, tmp_path, ["describe", "a b"], input="from stdin")
    assert forked.returncode == real.returncode == 0, forked.stderr
    assert forked.stdout == real.stdout  # argv, sys.path[0], __file__, cwd, environment, TMPDIR, threads, stdin
    assert '"threads": 1' in forked.stdout and forked.stderr.endswith("to stderr\n")


def test_a_module_run_as_python_m_runs_it(through, tmp_path):
    shim, env = through
    real, forked = (subprocess.run([python, "-m", "torch.distributed.run", "--help"], env=run_env, capture_output=True,
                                   text=True, timeout=120, cwd=tmp_path)
                    for python, run_env in ((sys.executable, subprocess_env()), (shim, env)))
    assert forked.returncode == real.returncode == 0
    assert (forked.stdout, forked.stderr) == (real.stdout, real.stderr)


@pytest.mark.parametrize("args, code", [(["exit", "3"], 3), (["raise"], 1)])
def test_exit_status_and_errors_as_python_gives_them(through, tmp_path, args, code):
    real, forked = run_both(through, tmp_path, args)
    assert forked.returncode == real.returncode == code
    assert real.stderr.strip().splitlines()[-1:] == forked.stderr.strip().splitlines()[-1:]


def start(through, tmp_path, mode):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    shim, env = through
    proc = subprocess.Popen([shim, str(script), mode], env=env, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_signals_reach_the_run_and_its_death_by_signal_comes_back(through, tmp_path):
    proc, pid = start(through, tmp_path, "term")
    assert pid != proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0 and proc.stdout.read() == "stopping\n"
    proc, pid = start(through, tmp_path, "sleep")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_client_takes_its_run_with_it(through, tmp_path):
    proc, pid = start(through, tmp_path, "sleep")
    assert alive(pid)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.time() + 30
    while time.time() < deadline and alive(pid):
        time.sleep(0.1)
    assert not alive(pid)
