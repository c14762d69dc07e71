"""Run PPO on one machine: start the critic server, wait until it is ready, run the actor, stop the server.

    python -m nemo_aligner.launchers.ppo_local \
        --critic pretrained_checkpoint.restore_from_path=rm.nemo exp_manager.explicit_log_dir=results/critic \
        --actor pretrained_checkpoint.restore_from_path=sft.nemo exp_manager.explicit_log_dir=results/actor \
                "++model.data.data_prefix={train: [prompts.jsonl], validation: [val.jsonl]}"

Both jobs get matching ports (a free one unless ``--port`` is given). ``--critic-nproc`` and
``--actor-nproc`` start them under torchrun. Unless ``OMP_NUM_THREADS`` is set, the machine's cores
are split evenly between the processes of both jobs: they run at the same time (the critic serves
while the actor generates and trains), and each torch process would otherwise use every core. The
server is stopped with SIGTERM after the actor has exited, whatever happened to it (the critic
saves only together with the actor, so the two checkpoints stay in step); the exit status is the
actor's. SIGTERM and SIGINT go on to both jobs, SIGUSR1 to the actor (it saves and stops).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from nemo_aligner.utils.examples_path import examples_dir
from nemo_aligner.utils.ports import free_port
from nemo_aligner.utils.self_launch import set_threads_per_process

SCRIPTS = examples_dir("nlp", "gpt")
READY = "critic server ready"


def server_ports(port: int) -> List[str]:
    """The critic server's port overrides: HTTP ``port``, free gRPC and metrics ports. ``++`` adds the
    last two where a user's own config (NeMo-Aligner's gpt_ppo_critic.yaml) has no such keys."""
    return [f"trainer.ppo.port={port}", f"++trainer.ppo.grpc_port={free_port()}",
            f"++trainer.ppo.metrics_port={free_port()}"]


def command(script: str, nproc: int, overrides: List[str]) -> List[str]:
    path = os.path.join(SCRIPTS, script)
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}", path, f"trainer.devices={nproc}", *overrides]
    return [sys.executable, path, *overrides]


def job_env(processes: int, environ=None) -> dict:
    """The environment of both jobs: ``OMP_NUM_THREADS`` (torch's intra-op threads) set to the
    available cores over ``processes`` when it is not set already. Oversubscribed cores cost more
    than they overlap: a tiny-model PPO step on 2 cores took 4.4 s with 2 threads per job, 3.5 s
    with 1 (``benchmarks/bench_ppo.py``)."""
    env = dict(os.environ if environ is None else environ)
    set_threads_per_process(processes, env)
    return env


def stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGTERM the process (and so its workers), then SIGKILL its group if it lingers."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_ready(proc: subprocess.Popen, log_path: str, timeout_s: float, offset: int = 0) -> None:
    """Wait for the server's ready line in ``log_path`` after byte ``offset`` (earlier runs' output)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
        if READY in text:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the critic server exited with status {proc.returncode} before it was ready; "
                               f"its log ({log_path}) ends with:\n{text[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"the critic server was not ready after {timeout_s:.0f}s; see {log_path}")


def pass_on(signum: int, actor: Optional[subprocess.Popen], critic: subprocess.Popen) -> None:
    """A stop signal this launcher received, to the jobs still running: SIGTERM and SIGINT to both,
    SIGUSR1 (the actor's "save and stop", Slurm's ``--signal``; the server has none) to the actor, or as
    SIGTERM to the server while the actor has not started."""
    if signum == signal.SIGUSR1:
        if actor is not None and actor.poll() is None:
            actor.send_signal(signum)
            return
        signum = signal.SIGTERM
    for proc in (actor, critic):
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)


def run(critic_overrides: List[str], actor_overrides: List[str], critic_nproc: int = 1, actor_nproc: int = 1,
        port: Optional[int] = None, critic_log: Optional[str] = None, ready_timeout_s: float = 600.0) -> int:
    port = port or free_port()
    critic_overrides = [*critic_overrides, *server_ports(port)]
    actor_overrides = [*actor_overrides, "remote_critic_rm.critic.ip=127.0.0.1", f"remote_critic_rm.critic.port={port}"]
    log_path = critic_log or tempfile.NamedTemporaryFile(prefix="critic_server_", suffix=".log", delete=False).name
    env = job_env(critic_nproc + actor_nproc)
    print(f"starting the critic server on 127.0.0.1:{port} (log: {log_path}); {env['OMP_NUM_THREADS']} "
          f"thread(s) per process", flush=True)
    # Appended to, so a resumed run keeps the previous run's server output.
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    with open(log_path, "a", encoding="utf-8") as log:
        if offset:
            log.write(f"\n===== ppo_local: a new run, {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
            log.flush()
        critic = subprocess.Popen(command("serve_ppo_critic.py", critic_nproc, critic_overrides), stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True, env=env)
    actor = None
    previous = {}

    def forward(signum, frame):
        pass_on(signum, actor, critic)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        previous[sig] = signal.signal(sig, forward)
    try:
        wait_ready(critic, log_path, ready_timeout_s, offset)
        print("critic server ready; starting the actor", flush=True)
        actor = subprocess.Popen(command("train_gpt_ppo_actor.py", actor_nproc, actor_overrides), env=env)
        code = actor.wait()
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        code = 1
    finally:
        if actor is not None:
            stop(actor)
        stop(critic)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"critic server stopped (status {critic.returncode}); actor status {code}", flush=True)
    return code


JOBS = ("--critic", "--actor")
OPTIONS = ("--critic-nproc", "--actor-nproc", "--port", "--critic-log", "--ready-timeout", "-h", "--help")


def split_jobs(argv: List[str]):
    """``(launcher options, {"--critic": [...], "--actor": [...]})``: each job's words run from its flag to
    the next job flag or launcher option, Hydra's own flags included (``--config-path``, ``-cn``), which
    argparse would take for options of its own."""
    rest, jobs, current = [], {job: [] for job in JOBS}, None
    for word in argv:
        if word in JOBS:
            current = word
        elif word.split("=", 1)[0] in OPTIONS:
            current = None
            rest.append(word)
        elif current is not None:
            jobs[current].append(word)
        else:
            rest.append(word)
    return rest, jobs


def main(argv=None) -> int:
    rest, jobs = split_jobs(sys.argv[1:] if argv is None else list(argv))
    parser = argparse.ArgumentParser(description="Run the PPO critic server and actor together on this machine.",
                                     usage="%(prog)s [options] --critic WORDS... --actor WORDS...")
    parser.add_argument("--critic", nargs="*", default=[], help="the words for serve_ppo_critic.py: overrides "
                        "and Hydra flags (--config-path, --config-name), up to --actor or a launcher option")
    parser.add_argument("--actor", nargs="*", default=[], help="the words for train_gpt_ppo_actor.py, as --critic's")
    parser.add_argument("--critic-nproc", type=int, default=1)
    parser.add_argument("--actor-nproc", type=int, default=1)
    parser.add_argument("--port", type=int, default=None, help="critic HTTP port (default: a free one)")
    parser.add_argument("--critic-log", default=None, help="file for the server's output, appended to (default: a temp file)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(rest)
    return run(jobs["--critic"], jobs["--actor"], args.critic_nproc, args.actor_nproc, args.port, args.critic_log,
               args.ready_timeout)


if __name__ == "__main__":
    sys.exit(main())
