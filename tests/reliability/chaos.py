"""Fault injection: ``kill -9`` the SFT trainer, the PPO actor and the PPO critic server at random
moments (during a step, during generation, during a checkpoint save), restart the same command
with ``exp_manager.resume_if_exists=True`` after each kill, and check that

- every complete checkpoint on disk stays loadable (each tensor of each one is read back), and
  the newest one never goes backwards (``checkpoints lost``);
- the restarted run continues from the newest complete checkpoint (``resumed``);
- the SFT run's per-step training losses, after all the kills, equal those of an uninterrupted run
  (``max |loss diff|``): a resumed run is the same run.

    python tests/reliability/chaos.py                        # 20 kills: 10 SFT, 10 PPO (~10 min on 2 cores)
    python tests/reliability/chaos.py --sft-kills 2 --ppo-kills 0 --steps 8

Prints ``target, kills, resumed, checkpoints lost`` as a table (and JSON with ``--json``). Exit
status 1 if any kill was not resumed, a checkpoint was lost, or the losses differ.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "examples", "nlp", "gpt")
sys.path.insert(0, REPO)
from nemo_aligner.utils.ports import free_port  # noqa: E402

TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
        "max_position_embeddings": 64, "position_embedding_type": "rope", "normalization": "rmsnorm",
        "activation": "swiglu", "bias": False, "share_embeddings_and_output_weights": False}


def env() -> dict:
    out = dict(os.environ)
    out["PYTHONPATH"] = REPO + os.pathsep + out.get("PYTHONPATH", "")
    out.setdefault("WANDB_MODE", "offline")
    out["OMP_NUM_THREADS"] = out.get("OMP_NUM_THREADS", "1")
    return out


class Proc:
    """A script in its own session (so a kill reaches its workers), its output in a log file."""

    def __init__(self, cmd: List[str], log_path: str):
        self.log_path = log_path
        self.log = open(log_path, "a", encoding="utf-8")
        self.log.write(f"\n===== {' '.join(cmd)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, env=env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def terminate(self, grace_s: float = 60.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.log.closed:
            self.log.close()

    def text(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


# ----------------------------------------------------------------- checkpoints
def verify_checkpoint(path: str) -> Optional[str]:
    """None if every tensor of the torch_dist checkpoint at ``path`` reads back; else why not."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            return "no trainer_state.json"
        with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
            json.load(f)
        reader = dcp.FileSystemReader(path)
        metadata = reader.read_metadata()
        state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
                 for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
        dcp.load(state, storage_reader=reader, no_dist=True)
        return None
    except (Exception, CheckpointException) as err:  # any failure to read is what this check is for
        return f"{type(err).__name__}: {err}"


def complete_checkpoints(directory: str) -> Dict[str, int]:
    """``{path: step}`` of the complete checkpoints (``*.tmp`` and replaced ``.old.`` ones excluded)."""
    from nemo_aligner.utils.checkpoint_callback import list_checkpoints

    return {path: int(state.get("step", 0)) for path, state in list_checkpoints(directory)}


def newest_step(directory: str) -> int:
    steps = complete_checkpoints(directory).values()
    return max(steps) if steps else 0


def saving_now(directory: str) -> bool:
    return bool(glob.glob(os.path.join(directory, "*.tmp")))


def read_metrics(log_dir: str) -> List[dict]:
    """metrics.jsonl rows; a line torn by a kill (only possible as the last line of a run) is skipped."""
    rows = []
    path = os.path.join(log_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def train_steps(log_dir: str, key: str) -> List[int]:
    return [r["step"] for r in read_metrics(log_dir) if key in r]


# ----------------------------------------------------------------- the chaos loop
class Tally:
    def __init__(self):
        self.rows: Dict[str, Dict[str, int]] = {}
        self.problems: List[str] = []

    def add(self, target: str, resumed: bool, lost: int) -> None:
        row = self.rows.setdefault(target, {"kills": 0, "resumed": 0, "checkpoints lost": 0})
        row["kills"] += 1
        row["resumed"] += int(resumed)
        row["checkpoints lost"] += lost


def check_after_kill(ckpt_dir: str, before: int, what: str, tally: Tally) -> int:
    """Checkpoints lost by a kill: unreadable complete ones, or the newest step going backwards."""
    lost = 0
    for path in complete_checkpoints(ckpt_dir):
        problem = verify_checkpoint(path)
        if problem and not os.path.isdir(path):  # pruned by a live server meanwhile: not lost
            continue
        if problem:
            lost += 1
            tally.problems.append(f"{what}: {path} is not loadable: {problem}")
    after = newest_step(ckpt_dir)
    if after < before:
        lost += 1
        tally.problems.append(f"{what}: newest checkpoint went from step {before} to {after}")
    return lost


def wait_for(predicate: Callable[[], bool], proc: Proc, timeout_s: float, poll_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if not proc.alive():
            return False
        time.sleep(poll_s)
    return False


def sft_command(data: dict, log_dir: str, steps: int) -> List[str]:
    return [sys.executable, os.path.join(SCRIPTS, "train_gpt_sft.py"),
            f"model.data.train_ds.file_path={data['sft_train']}", f"model.data.validation_ds.file_path={data['sft_val']}",
            f"exp_manager.explicit_log_dir={log_dir}", f"trainer.sft.max_steps={steps}", "trainer.sft.max_epochs=1000",
            "trainer.sft.val_check_interval=0", "trainer.sft.save_interval=2", "exp_manager.resume_if_exists=True",
            "exp_manager.resume_ignore_no_checkpoint=True", "exp_manager.create_checkpoint_callback=True",
            "exp_manager.checkpoint_callback_params.save_top_k=2", "model.data.train_ds.global_batch_size=8",
            "model.data.train_ds.micro_batch_size=8", "model.encoder_seq_length=64",
            *[f"model.{k}={v}" for k, v in TINY.items()]]


def run_sft(work: str, data: dict, kills: int, steps: int, rng: random.Random, tally: Tally) -> float:
    """``kills`` kill -9s of one SFT run; returns the largest per-step loss difference to an uninterrupted run."""
    reference = os.path.join(work, "sft_reference")
    done = subprocess.run(sft_command(data, reference, steps), env=env(), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the uninterrupted SFT run failed:\n{done.stderr[-3000:]}")
    log_dir = os.path.join(work, "sft_chaos")
    ckpt_dir = os.path.join(log_dir, "checkpoints")
    log_path = os.path.join(work, "sft_chaos.log")
    start = lambda: Proc(sft_command(data, log_dir, steps), log_path)  # noqa: E731
    proc = start()
    for i in range(kills):
        mode = "save" if i % 2 == 0 else "step"
        before = newest_step(ckpt_dir)  # a lower bound of what the kill must not lose
        if mode == "save":  # the moment a checkpoint write starts: kill at once
            wait_for(lambda: saving_now(ckpt_dir), proc, 180, poll_s=0.002)
        else:  # a random moment after the next logged step
            rows = len(train_steps(log_dir, "train/loss"))
            wait_for(lambda: len(train_steps(log_dir, "train/loss")) > rows, proc, 180)
            time.sleep(rng.uniform(0.0, 1.5))
            before = newest_step(ckpt_dir)
        if not proc.alive():
            tally.problems.append(f"SFT kill {i + 1}: the run ended before the kill (raise --steps); see {log_path}")
            break
        proc.kill9()
        during_save = saving_now(ckpt_dir)  # the killed writer's .tmp is left behind
        lost = check_after_kill(ckpt_dir, before, f"SFT kill {i + 1} ({mode})", tally)
        resumed, proc = restart_and_check(log_dir, ckpt_dir, "train/loss", start, tally, f"SFT kill {i + 1}", log_path)
        print(f"SFT kill {i + 1}/{kills} ({mode}{', during a save' if during_save else ''}): resumed={resumed} "
              f"lost={lost}", flush=True)
        tally.add("sft trainer", resumed, lost)
    proc.proc.wait()
    proc.terminate()
    if proc.proc.returncode != 0:
        tally.problems.append(f"the final SFT run failed; see {log_path}")
    ref = {r["step"]: r["train/loss"] for r in read_metrics(reference) if "train/loss" in r}
    got = {r["step"]: r["train/loss"] for r in read_metrics(log_dir) if "train/loss" in r}  # the last run of a step wins
    if sorted(got) != sorted(ref):
        tally.problems.append(f"SFT steps differ from the uninterrupted run: {sorted(set(ref) ^ set(got))}")
        return float("inf")
    return max(abs(got[s] - ref[s]) for s in ref)


def restart_and_check(log_dir: str, ckpt_dir: str, key: str, start: Callable[[], Proc], tally: Tally, what: str,
                      log_path: str, timeout_s: float = 300.0):
    """Start the same command again; resumed if its first logged step follows the newest checkpoint.
    Returns ``(resumed, the running process)``: it is the next kill's target."""
    newest = newest_step(ckpt_dir)
    rows = len(train_steps(log_dir, key))
    proc = start()
    ok = wait_for(lambda: len(train_steps(log_dir, key)) > rows, proc, timeout_s)
    first = train_steps(log_dir, key)[rows] if ok else None
    if first != newest + 1:
        tally.problems.append(f"{what}: the restarted run logged step {first} first, expected {newest + 1} "
                              f"(newest checkpoint: step {newest}); see {log_path}")
        return False, proc
    return True, proc


# ----------------------------------------------------------------- PPO
def make_ppo_models(work: str) -> Dict[str, str]:
    """Tiny randomly initialised actor (GPT) and reward-model .nemo files, written by a subprocess."""
    code = f"""
import torch
from omegaconf import OmegaConf
from nemo_aligner.utils import distributed as D
D.init_distributed(); D.initialize_model_parallel(1, 1)
from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
from nemo_aligner.utils.nemo_file import save_nemo
from nemo_aligner.utils.tokenizers import ByteTokenizer
cfg = OmegaConf.create(dict({TINY!r}, micro_batch_size=2, encoder_seq_length=64))
torch.manual_seed(0); save_nemo(GPTSFTModel(cfg, ByteTokenizer()), {os.path.join(work, 'actor.nemo')!r})
torch.manual_seed(1); save_nemo(MegatronGPTRewardModel(cfg, ByteTokenizer(), trainable=False), {os.path.join(work, 'rm.nemo')!r})
"""
    done = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"making the PPO models failed:\n{done.stderr[-3000:]}")
    return {"actor": os.path.join(work, "actor.nemo"), "rm": os.path.join(work, "rm.nemo")}


class PPORun:
    """The critic server and the actor of one PPO run, started separately so either can be killed."""

    def __init__(self, work: str, data: dict, models: dict, steps: int):
        self.work = work
        self.data = data
        self.models = models
        self.steps = steps
        self.actor_dir = os.path.join(work, "ppo_actor")
        self.critic_dir = os.path.join(work, "ppo_critic")
        self.critic: Optional[Proc] = None
        self.port = free_port()

    def critic_command(self) -> List[str]:
        # a fresh workspace per start (a killed critic leaves its own behind), short for PyTriton's socket paths
        workspace = tempfile.mkdtemp(prefix="ws_", dir="/tmp")
        atexit.register(shutil.rmtree, workspace, True)
        return [sys.executable, os.path.join(SCRIPTS, "serve_ppo_critic.py"),
                f"pretrained_checkpoint.restore_from_path={self.models['rm']}",
                f"exp_manager.explicit_log_dir={self.critic_dir}", "exp_manager.resume_if_exists=True",
                "exp_manager.resume_ignore_no_checkpoint=True", f"trainer.ppo.port={self.port}",
                f"trainer.ppo.grpc_port={free_port()}", f"trainer.ppo.metrics_port={free_port()}",
                f"trainer.ppo.workspace_dir={workspace}",
                "model.global_batch_size=16", "model.micro_batch_size=8", "model.forward_micro_batch_size=8"]

    def actor_command(self) -> List[str]:
        return [sys.executable, os.path.join(SCRIPTS, "train_gpt_ppo_actor.py"),
                f"pretrained_checkpoint.restore_from_path={self.models['actor']}",
                f"++model.data.data_prefix={{train: [{self.data['prompts_train']}], "
                f"validation: [{self.data['prompts_val']}]}}",
                f"exp_manager.explicit_log_dir={self.actor_dir}", f"trainer.ppo.max_steps={self.steps}",
                "trainer.ppo.max_epochs=100", "trainer.ppo.save_interval=1", "trainer.ppo.val_check_interval=0",
                "exp_manager.resume_if_exists=True", "exp_manager.resume_ignore_no_checkpoint=True",
                "model.ppo.num_rollout_samples=16", "model.global_batch_size=16", "model.micro_batch_size=8",
                "model.ppo.rollout_micro_batch_size=16", "model.ppo.length_params.max_length=16",
                "model.ppo.num_val_samples=16", "remote_critic_rm.critic.ip=127.0.0.1",
                f"remote_critic_rm.critic.port={self.port}",
                # the shipped timeout_s/max_retries: a killed critic must stop the actor quickly with them
                "remote_critic_rm.wait_for_server_s=120"]

    def start_critic(self) -> Proc:
        """Start the server and wait until it serves (its checkpoint loaded, its ports bound)."""
        self.port = free_port()
        self.critic = Proc(self.critic_command(), os.path.join(self.work, "ppo_critic.log"))
        if not wait_for(lambda: "critic server ready" in self.critic.text().split("=====")[-1], self.critic, 300, 0.2):
            raise RuntimeError(f"the critic server did not start; see {self.critic.log_path}")
        return self.critic

    def stop_critic(self) -> None:
        if self.critic is not None:
            self.critic.terminate()
            self.critic = None


def run_ppo(work: str, data: dict, kills: int, steps: int, rng: random.Random, tally: Tally) -> None:
    """Kill the actor (while it generates, or while it saves) or the critic server; an actor is
    restarted alone (the server keeps serving, as on a cluster), a dead server is restarted with
    the actor, which must have stopped by itself with an error naming the server's config key."""
    models = make_ppo_models(work)
    run = PPORun(work, data, models, steps)
    ckpt = os.path.join(run.actor_dir, "checkpoints")
    critic_ckpt = os.path.join(run.critic_dir, "checkpoints")
    actor_log = os.path.join(work, "ppo_actor.log")
    start_actor = lambda: Proc(run.actor_command(), actor_log)  # noqa: E731
    run.start_critic()
    actor = start_actor()
    modes = ["generation", "save", "critic"]
    try:
        for i in range(kills):
            mode = modes[i % len(modes)]
            save_before = newest_step(ckpt)
            if mode == "save":
                wait_for(lambda: saving_now(ckpt), actor, 300, poll_s=0.002)
            else:  # the actor is mostly generating: a random moment after its next logged step
                rows = len(train_steps(run.actor_dir, "train/rewards"))
                wait_for(lambda: len(train_steps(run.actor_dir, "train/rewards")) > rows, actor, 300)
                time.sleep(rng.uniform(0.0, 2.0))
            if not actor.alive():
                tally.problems.append(f"PPO kill {i + 1}: the actor ended before the kill; see {actor_log}")
                break
            before, critic_before = newest_step(ckpt) if mode != "save" else save_before, newest_step(critic_ckpt)
            if mode == "critic":
                run.critic.kill9()
                # The actor notices on its next request and stops by itself, naming the server's key.
                try:
                    actor.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    pass
                if actor.alive() or "remote_critic_rm" not in actor.text().split("=====")[-1]:
                    tally.problems.append(f"PPO kill {i + 1}: the actor did not stop with an error naming "
                                          f"remote_critic_rm after the critic died; see {actor_log}")
                actor.terminate()
                run.critic = None
            else:
                actor.kill9()
            if mode == "save" and saving_now(ckpt):
                mode = "save, during a save"
            lost = check_after_kill(ckpt, before, f"PPO kill {i + 1} ({mode}): actor", tally)
            lost += check_after_kill(critic_ckpt, critic_before, f"PPO kill {i + 1} ({mode}): critic", tally)
            if run.critic is None:
                run.start_critic()
            resumed, actor = restart_and_check(run.actor_dir, ckpt, "train/rewards", start_actor, tally,
                                               f"PPO kill {i + 1}", actor_log)
            print(f"PPO kill {i + 1}/{kills} ({mode}): resumed={resumed} lost={lost}", flush=True)
            tally.add("ppo critic server" if mode == "critic" else "ppo actor", resumed, lost)
        actor.proc.wait(timeout=900)
        if actor.proc.returncode != 0:
            tally.problems.append(f"the final PPO actor run failed; see {actor_log}")
    finally:
        actor.terminate()
        run.stop_critic()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft-kills", type=int, default=10)
    parser.add_argument("--ppo-kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=400, help="SFT steps (~10 per second; PPO: a fifth, ~2 per second)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep everything here (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    work = args.workdir or tempfile.mkdtemp(prefix="chaos_")
    os.makedirs(work, exist_ok=True)
    data = BuiltinTask(seed=0).write_all(os.path.join(work, "data"), n_train=800, n_val=32)
    rng = random.Random(args.seed)
    tally = Tally()
    start = time.monotonic()
    loss_diff = None
    if args.sft_kills:
        loss_diff = run_sft(work, data, args.sft_kills, args.steps, rng, tally)
    if args.ppo_kills:
        run_ppo(work, data, args.ppo_kills, max(args.steps // 5, 8 * args.ppo_kills), rng, tally)
    print(f"\nkill -9 fault injection ({time.monotonic() - start:.0f}s; logs and checkpoints in {work})")
    print(f"{'target':<20} {'kills':>6} {'resumed':>8} {'checkpoints lost':>17}")
    for target, row in tally.rows.items():
        print(f"{target:<20} {row['kills']:>6} {row['resumed']:>8} {row['checkpoints lost']:>17}")
    total = {k: sum(r[k] for r in tally.rows.values()) for k in ("kills", "resumed", "checkpoints lost")}
    print(f"{'total':<20} {total['kills']:>6} {total['resumed']:>8} {total['checkpoints lost']:>17}")
    if loss_diff is not None:
        print(f"SFT losses after the kills vs an uninterrupted run: max |diff| = {loss_diff:.3g}")
    for problem in tally.problems:
        print("problem:", problem)
    result = {"rows": tally.rows, "total": total, "sft_max_loss_diff": loss_diff, "problems": tally.problems,
              "workdir": work}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    ok = not tally.problems and total["resumed"] == total["kills"] and total["checkpoints lost"] == 0 \
        and (loss_diff is None or loss_diff <= 1e-5)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
