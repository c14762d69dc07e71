"""Server fuzzing: the PPO critic server (``serve_ppo_critic.py``), the PPO actor that talks to it
(``train_gpt_ppo_actor.py``), the reward-model server (``serve_reward_model.py``) and the text
generation server (``generate_gpt.py server=True``), each run with one hostile value for a key drawn
from its shipped config, on tiny models and the built-in prompts.

A run of a server target starts the fuzzed server and, once it says it is ready, uses it as a user
would: the PPO actor trains 2 steps against the critic; a client scores three texts on the reward
model server; a client asks the text generation server for two responses. Then the server gets
SIGTERM (a second one if the critic keeps serving an actor it takes to be mid-step) and must exit 0
within a minute. A run of ``ppo`` fuzzes the actor against a fresh base critic.

    python tests/reliability/fuzz_servers.py                    # 80 runs, seed 0, all four (~17 min on 2 cores)
    python tests/reliability/fuzz_servers.py --runs 20 --seed 3 --targets rm_server

Outcomes as ``fuzz_config.py``, plus ``BROKEN``: the server said it was ready but did not serve
(the actor or client failed with a traceback, or the server did not stop cleanly). Exit status 1
if any run ended in a traceback, a hang or a broken server.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from chaos import Proc, make_ppo_models  # noqa: E402
from fuzz_config import SCRIPTS, SKIPPED, arguments, finished, hostile_values, leaves, outcome, run, run_all  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from nemo_aligner.data.nlp.builtin_task import BuiltinTask  # noqa: E402
from nemo_aligner.utils.ports import free_port  # noqa: E402

CONFIGS = {"critic": "gpt_ppo_critic", "ppo": "gpt_ppo_actor", "rm_server": "inference_rm",
           "text_server": "gpt_generate"}
READY = {"critic": "critic server ready", "rm_server": "reward model server ready", "text_server": "serving "}
TEXTS = ["What is 2+3? 5", "What is 7-4? 2", "hello"]
STOP_GRACE_S = 60.0
READY_S = 180.0


class Server:
    """One server subprocess in its own session, its output in a log file."""

    def __init__(self, target: str, extra: list, run_dir: str, models: dict):
        os.makedirs(run_dir, exist_ok=True)
        self.target, self.run_dir = target, run_dir
        ports = [f"port={free_port()}", f"grpc_port={free_port()}", f"metrics_port={free_port()}"]
        self.workspace = tempfile.mkdtemp(prefix="ws_", dir="/tmp")  # short: PyTriton's socket paths
        workspace = f"workspace_dir={self.workspace}"
        if target == "critic":
            cmd = [os.path.join(SCRIPTS, "serve_ppo_critic.py"),
                   f"pretrained_checkpoint.restore_from_path={models['rm']}",
                   f"exp_manager.explicit_log_dir={os.path.join(run_dir, 'critic')}",
                   *[f"trainer.ppo.{p}" for p in ports + [workspace]],
                   "model.global_batch_size=4", "model.micro_batch_size=2", "model.forward_micro_batch_size=4"]
        elif target == "rm_server":
            cmd = [os.path.join(SCRIPTS, "serve_reward_model.py"), f"rm_model_file={models['rm']}",
                   *[f"inference.{p}" for p in ports + [workspace]], "inference.micro_batch_size=2"]
        else:
            cmd = [os.path.join(SCRIPTS, "generate_gpt.py"), f"gpt_model_file={models['actor']}", "server=True",
                   ports[0]]
        self.proc = Proc([sys.executable] + cmd + extra, os.path.join(run_dir, f"{target}.log"))

    def wait_ready(self):
        """``(host, port)`` from the ready line, or None if the server exited or hung first."""
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            text = self.proc.text()
            if READY[self.target] in text:
                found = re.search(r" on (?:https?://)?\[?([^\]\s/]+?)\]?:(\d+)", text.split(READY[self.target], 1)[1])
                return (found.group(1), int(found.group(2))) if found else ("127.0.0.1", None)
            if not self.proc.alive():
                return None
            time.sleep(0.2)
        return None

    def stop(self):
        """SIGTERM (a second one if the critic keeps serving a mid-step actor); the exit status, or
        "timeout" if it did not stop within STOP_GRACE_S."""
        proc = self.proc.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while proc.poll() is None and time.monotonic() < deadline:
                if "SIGTERM while the actor is mid-step" in self.proc.text():
                    proc.send_signal(signal.SIGTERM)
                    break
                time.sleep(0.2)
        try:
            proc.wait(timeout=STOP_GRACE_S)
            return proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"
        finally:
            self.proc.log.close()
            shutil.rmtree(self.workspace, ignore_errors=True)


def actor_command(run_dir: str, data: dict, models: dict, critic_port: int) -> list:
    return [sys.executable, os.path.join(SCRIPTS, "train_gpt_ppo_actor.py"),
            f"pretrained_checkpoint.restore_from_path={models['actor']}",
            f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
            f"exp_manager.explicit_log_dir={os.path.join(run_dir, 'actor')}", "exp_manager.resume_if_exists=False",
            "trainer.ppo.max_steps=2", "trainer.ppo.val_check_interval=2", "model.ppo.num_rollout_samples=4",
            "model.ppo.num_val_samples=4", "model.global_batch_size=4", "model.micro_batch_size=2",
            "model.ppo.rollout_micro_batch_size=4", "model.ppo.length_params.max_length=8",
            "remote_critic_rm.critic.ip=127.0.0.1", f"remote_critic_rm.critic.port={critic_port}",
            "remote_critic_rm.timeout_s=120", "remote_critic_rm.max_retries=0"]


def score_texts(host: str, port: int) -> str:
    """A client scoring TEXTS: "" if it got one finite reward per text, else why not."""
    code = ("import sys, numpy as np\n"
            "from nemo_aligner.servers.clients import RemoteGPTRMClient\n"
            "from nemo_aligner.utils.tokenizers import ByteTokenizer\n"
            f"with RemoteGPTRMClient({host!r}, {port}, tokenizer=ByteTokenizer(), timeout_s=60) as c:\n"
            f"    got = np.asarray(c.infer_texts({TEXTS!r}).result())\n"
            f"assert got.shape == ({len(TEXTS)},) and np.isfinite(got).all(), got\n")
    rc, out = run([sys.executable, "-c", code], os.getcwd(), 120)
    return "" if rc == 0 else f"client: exit {rc}\n{out}"


def generate_text(host: str, port: int) -> str:
    """A PUT /generate for two prompts: "" if it answered with two sentences, else why not."""
    import json
    import urllib.request

    body = json.dumps({"sentences": TEXTS[:2], "tokens_to_generate": 4}).encode()
    request = urllib.request.Request(f"http://{host}:{port}/generate", data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            sentences = json.loads(answer.read())["sentences"]
        return "" if len(sentences) == 2 and all(isinstance(x, str) for x in sentences) else f"answered {sentences!r}"
    except Exception as err:  # any failure to be served is what this check reports
        return f"client: {type(err).__name__}: {err}"


def serve_and_use(target: str, server_extra: list, actor_extra: list, run_dir: str, data: dict, models: dict,
                  timeout_s: float) -> dict:
    """One run: start the server, use it, stop it; the verdict over both sides."""
    server = Server(target if target != "ppo" else "critic", server_extra, run_dir, models)
    address, hung = None, False
    try:
        address = server.wait_ready()
        hung = address is None and server.proc.alive()
        if address is not None:
            host, port = address
            if target in ("rm_server", "text_server"):
                problem = (score_texts if target == "rm_server" else generate_text)(host, port)
                client_rc, client_out = (0, "") if not problem else (1, problem)
            else:
                client_rc, client_out = run(actor_command(run_dir, data, models, port) + actor_extra, run_dir,
                                            timeout_s)
    finally:
        rc = server.stop()
    text = server.proc.text()
    if address is None:
        if target == "ppo":  # the base server must start
            return {"verdict": "BROKEN",
                    "last_lines": ["the base critic server did not start"] + text.splitlines()[-10:]}
        return outcome("timeout" if hung else rc, text)
    client = outcome(client_rc, client_out)
    if "Traceback (most recent call last)" in text:
        return {"verdict": "TRACEBACK", "last_lines": ["(server)"] + text.strip().splitlines()[-12:]}
    if rc != 0:
        return {"verdict": "BROKEN",
                "last_lines": [f"(server exit {rc} after SIGTERM)"] + text.strip().splitlines()[-8:]}
    if target != "ppo" and client["verdict"] != "accepted":
        # the fuzzed server said it was ready: its user must be served (or refused in one line)
        verdict = "BROKEN" if client["verdict"] in ("TRACEBACK", "timeout") or target != "critic" else "refused"
        return {"verdict": verdict, "last_lines": ["(client)"] + client["last_lines"]}
    return client


def main(argv=None) -> int:
    args = arguments(__doc__, 80, list(CONFIGS)).parse_args(argv)
    work = tempfile.mkdtemp(prefix="fuzz_servers_")
    os.chdir(work)  # relative paths a fuzzed value names (workspace_dir=abc) land here
    data = BuiltinTask(seed=0).write_all(os.path.join(work, "data"), n_train=64, n_val=16)
    models = make_ppo_models(work)
    base = serve_and_use("critic", [], [], os.path.join(work, "base", "critic"), data, models, args.timeout_s)
    if base["verdict"] != "accepted":
        raise SystemExit("the base PPO run failed:\n" + "\n".join(base["last_lines"]))
    for target in {"rm_server", "text_server"} & set(args.targets):
        base = serve_and_use(target, [], [], os.path.join(work, "base", target), data, models, args.timeout_s)
        if base["verdict"] != "accepted":
            raise SystemExit(f"the base {target} run failed:\n" + "\n".join(base["last_lines"]))
    cases = []
    for target in args.targets:
        shipped = OmegaConf.load(os.path.join(SCRIPTS, "conf", CONFIGS[target] + ".yaml"))
        for key, default in leaves(shipped):
            if not any(s in key for s in SKIPPED + ("rm_model_file", "gpt_model_file", "prompts_file", "output_file")):
                cases += [(target, key, value) for value in hostile_values(default)]
    random.Random(args.seed).shuffle(cases)
    cases = list(enumerate(cases[: args.runs]))

    def one(case):
        i, (target, key, value) = case
        fuzzed = [f"++{key}={value}"]
        server_extra, actor_extra = ([], fuzzed) if target == "ppo" else (fuzzed, [])
        result = serve_and_use(target, server_extra, actor_extra, os.path.join(work, "runs", str(i)), data, models,
                               args.timeout_s)
        return {"target": target, "key": key, "value": value, **result}

    return finished(work, run_all(cases, one, args.workers, args.json, lambda r: f"{r['target']} {r['key']}={r['value']}",
                                  failures=("TRACEBACK", "timeout", "BROKEN")), args.keep)


if __name__ == "__main__":
    sys.exit(main())
