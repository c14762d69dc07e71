"""Leftovers of killed PyTriton servers: removed when stale, kept while anything alive uses them."""

import os
import subprocess
import sys
import tempfile
import time

import pytest

from nemo_aligner.servers import leftovers


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(leftovers, "SHM_DIR", str(shm))
    monkeypatch.setattr(leftovers, "SYSTEM_TMP", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(leftovers, "tritonserver_pids", lambda uid: [])  # other tests' servers
    return shm, tmp


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def model_folder(path, age_s):
    (path / "1").mkdir(parents=True)
    (path / "config.pbtxt").write_text("name: 'm'\n")
    (path / "1" / "model.py").write_text("# PyTriton proxy model\n")
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_only_stale_leftovers_are_removed(dirs):
    shm, tmp = dirs
    dead, alive = dead_pid(), os.getpid()
    old = time.time() - 120
    made = {}
    for name in (f"pytrtion{dead}-a", f"pytrtion{alive}-b", "psm_old", "psm_open", "psm_new"):
        made[name] = shm / name
        made[name].write_bytes(b"\0" * 16)
    for name in ("psm_old", "psm_open"):
        os.utime(made[name], (old, old))
    for name in (f"pytriton_{dead}_x", f"pytriton_{alive}_y"):
        made[name] = tmp / name
        (made[name] / "workspace").mkdir(parents=True)
    made["folderAAAAAA"] = model_folder(tmp / "folderAAAAAA", 120)  # a killed Triton's model folder
    made["folderBBBBBB"] = model_folder(tmp / "folderBBBBBB", 5)  # too new to tell
    made["folderCCCCCC"] = model_folder(tmp / "folderCCCCCC", 120)  # a live stub names it
    made["folderDDDDDD"] = tmp / "folderDDDDDD"  # not Triton's
    made["folderDDDDDD"].mkdir()
    os.utime(made["folderDDDDDD"], (old, old))
    for name, files in (("python_env_AAAAAA", 0), ("python_env_BBBBBB", 1), ("python_env_CCCCCC", 0)):
        made[name] = tmp / name  # Triton's execution-environment folders: only empty ones go
        made[name].mkdir()
        if files:
            (made[name] / "env.tar.gz").write_bytes(b"x")
        if name != "python_env_CCCCCC":  # too new to tell
            os.utime(made[name], (old, old))
    stub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             str(made["folderCCCCCC"] / "1" / "model.py")])
    held = open(made["psm_open"], "rb")
    try:
        removed = leftovers.remove_stale()
    finally:
        held.close()
        stub.kill()
        stub.wait()
    expected = {f"pytrtion{dead}-a", "psm_old", f"pytriton_{dead}_x", "folderAAAAAA", "python_env_AAAAAA"}
    assert {os.path.basename(p) for p in removed} == expected
    for name, path in made.items():
        assert path.exists() == (name not in expected), name


def test_triton_environment_folders_stay_while_a_tritonserver_runs(dirs, monkeypatch):
    """Nothing names a live server's python_env folder (it is only made and, at exit, removed): while any
    tritonserver of this user runs, none is taken."""
    _, tmp = dirs
    env = tmp / "python_env_EEEEEE"
    env.mkdir()
    old = time.time() - 120
    os.utime(env, (old, old))
    monkeypatch.setattr(leftovers, "tritonserver_pids", lambda uid: [12345])
    assert leftovers.remove_stale() == [] and env.exists()
    monkeypatch.setattr(leftovers, "tritonserver_pids", lambda uid: [])
    assert leftovers.remove_stale() == [str(env)] and not env.exists()


def test_a_running_tritonserver_is_seen(tmp_path):
    """A process whose name is tritonserver (a copy of sleep under that name) is found by its uid."""
    import shutil

    fake = tmp_path / "tritonserver"
    shutil.copy(shutil.which("sleep"), fake)
    proc = subprocess.Popen([str(fake), "30"])
    try:
        deadline = time.time() + 10
        while proc.pid not in leftovers.tritonserver_pids(os.getuid()) and time.time() < deadline:
            time.sleep(0.05)
        assert proc.pid in leftovers.tritonserver_pids(os.getuid())
        assert proc.pid not in leftovers.tritonserver_pids(os.getuid() + 12345)
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in leftovers.tritonserver_pids(os.getuid())


def fake_stub(tmp_path, owner_pid):
    """A process that looks like a Triton Python-backend stub: a copy of the shell under the stub's name,
    waiting on a pipe, with the stub's arguments (model file, ``pytrtion<owner pid>-`` shared memory)."""
    import shutil

    exe = tmp_path / f"ws{owner_pid}" / "backends" / "python" / "triton_python_backend_stub"
    exe.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.realpath("/bin/sh"), exe)
    proc = subprocess.Popen([str(exe), "-c", "read line", "/tmp/folderXXXXXX/1/model.py",
                             f"pytrtion{owner_pid}-0123456789abcdef-x"], stdin=subprocess.PIPE)
    deadline = time.time() + 10
    while proc.pid not in [pid for pid, _, _ in leftovers.stub_processes(os.getuid())] and time.time() < deadline:
        time.sleep(0.05)
    return proc, exe


def test_stubs_of_exited_servers_are_stopped_and_others_kept(tmp_path):
    """Python-backend stubs left by a crashed tritonserver: those whose PyTriton process has exited are
    killed when a server starts, those of a tritonserver that exited under a live server by workspace;
    a live server's stubs are kept."""
    orphan, _ = fake_stub(tmp_path, dead_pid())
    live, live_exe = fake_stub(tmp_path, os.getpid())
    try:
        found = {pid: argv for pid, _, argv in leftovers.stub_processes(os.getuid())}
        assert orphan.pid in found and live.pid in found, found
        assert orphan.pid in leftovers.orphaned_stubs() and live.pid not in leftovers.orphaned_stubs()
        assert orphan.pid in leftovers.kill_orphaned_stubs()
        assert orphan.wait(timeout=10) == -9 and live.poll() is None
        assert leftovers.kill_stubs_under(str(tmp_path / "elsewhere")) == [] and live.poll() is None
        assert leftovers.kill_stubs_under(str(live_exe.parents[2])) == [live.pid]
        assert live.wait(timeout=10) == -9
    finally:
        for proc in (orphan, live):
            proc.kill()
            proc.wait()
            proc.stdin.close()


def test_command_line_lists_without_removing(dirs, tmp_path):
    shm, _ = dirs
    stale = shm / f"pytrtion{dead_pid()}-z"
    stale.write_bytes(b"x")
    orphan, _ = fake_stub(tmp_path, dead_pid())
    try:
        env = dict(os.environ)
        proc = subprocess.run([sys.executable, "-c", f"""
import sys
from nemo_aligner.servers import leftovers
leftovers.SHM_DIR = {str(shm)!r}
sys.argv = ['leftovers', '--dry-run']
leftovers.main()
"""], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert str(stale) in proc.stdout.splitlines() and stale.exists()
        assert f"process {orphan.pid} (a Python-backend stub of an exited server)" in proc.stdout.splitlines()
        assert orphan.poll() is None  # listed, not stopped
    finally:
        orphan.kill()
        orphan.wait()
        orphan.stdin.close()
