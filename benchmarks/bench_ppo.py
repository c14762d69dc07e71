"""PPO step time by phase: the actor job and the critic server (reward model co-located) on this
machine, started together by ``nemo_aligner.launchers.ppo_local`` as users run them, on the same
model, prompts and lengths as ``bench_grpo.py``. TRL has no PPO trainer any more (``bench_grpo.py``
compares GRPO with TRL's), so the baseline here is the same run's serial cost: the actor's own
phases plus every second the server was busy (``critic/time/infer``, ``critic/time/train``, logged
by the server), i.e. the step if the actor had waited for every critic request. The ratio
measured / serial shows what overlapping the critic with the actor saves; the hidden share is the
part of the server's busy time the actor did not wait for.

    python benchmarks/bench_ppo.py [--shape tiny] [--rollouts 64] [--new-tokens 64] [--steps 8]

Both jobs start with their own processes (a minute or so of start-up each run); times are per step
over ``--steps`` steps after one warm-up step. On a 2-core CPU the two processes share the cores,
so overlapping helps less than on separate GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import torch

from common import cpu_model, init_single_process, machine, model_cfg, scratch_dir, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_models(shape: str, seq: int, work: str):
    """A randomly initialised actor (GPT) and reward model/critic of ``shape``, as .nemo files."""
    from omegaconf import OmegaConf

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.utils.nemo_file import save_nemo
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    cfg = OmegaConf.create(model_cfg(shape, seq))
    torch.manual_seed(0)
    actor = save_nemo(GPTSFTModel(cfg, ByteTokenizer(), trainable=False), os.path.join(work, "actor.nemo"))
    torch.manual_seed(1)
    rm = save_nemo(MegatronGPTRewardModel(cfg, ByteTokenizer(), trainable=False), os.path.join(work, "rm.nemo"))
    return actor, rm


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts (prompts) per PPO step")
    parser.add_argument("--rollout-micro-batch", type=int, default=32,
                        help="rollouts generated per call; each call's responses go to the critic at once")
    parser.add_argument("--micro-batch", type=int, default=16, help="training and log-prob micro-batch, both jobs")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after one warm-up step)")
    parser.add_argument("--critic-overrides", nargs="*", default=[], help="more Hydra overrides for the critic server")
    parser.add_argument("--actor-overrides", nargs="*", default=[], help="more Hydra overrides for the actor")
    args = parser.parse_args(argv)

    from nemo_aligner.data.nlp.builtin_task import BuiltinTask
    from nemo_aligner.data.nlp.jsonl import read_jsonl

    init_single_process()  # the models are built here only to be saved
    work = scratch_dir("bench_ppo_")
    seq = 128
    actor_nemo, rm_nemo = save_models(args.shape, seq, work)
    data = BuiltinTask(seed=0).write_all(os.path.join(work, "data"), n_train=args.rollouts * (args.steps + 2), n_val=16)
    critic_dir, actor_dir = os.path.join(work, "critic"), os.path.join(work, "actor")
    batch = [f"model.global_batch_size={args.rollouts}", f"model.micro_batch_size={args.micro_batch}",
             f"model.encoder_seq_length={seq}"]
    critic = [f"pretrained_checkpoint.restore_from_path={rm_nemo}", f"exp_manager.explicit_log_dir={critic_dir}",
              f"model.forward_micro_batch_size={args.micro_batch}", *batch, *args.critic_overrides]
    # One optimizer step per rollout batch (no rollout log-prob pass), exactly --new-tokens tokens
    # per response, no validation or checkpoints inside the timed steps: as bench_grpo.py.
    actor = [f"pretrained_checkpoint.restore_from_path={actor_nemo}", f"exp_manager.explicit_log_dir={actor_dir}",
             f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
             f"trainer.ppo.max_steps={args.steps + 1}", "trainer.ppo.max_epochs=100", "trainer.ppo.val_check_interval=0",
             "trainer.ppo.val_at_start=False", "trainer.ppo.save_interval=0", "trainer.ppo.critic_warmup_steps=0",
             f"model.ppo.num_rollout_samples={args.rollouts}",
             f"model.ppo.rollout_micro_batch_size={args.rollout_micro_batch}",
             f"model.ppo.length_params.max_length={args.new_tokens}",
             f"model.ppo.length_params.min_length={args.new_tokens}", "model.ppo.sampling_params.end_strings=[]",
             f"model.ppo.forward_micro_batch_size={args.micro_batch}", *batch, *args.actor_overrides]
    log = os.path.join(work, "ppo_local.log")
    cmd = [sys.executable, "-m", "nemo_aligner.launchers.ppo_local", "--critic-log", os.path.join(work, "critic.log"),
           "--critic", *critic, "--actor", *actor]
    print(f"running PPO ({args.steps + 1} steps; output in {log})", flush=True)
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        with open(log, encoding="utf-8", errors="replace") as f:
            raise SystemExit(f"PPO failed (status {code}):\n{f.read()[-4000:]}")

    prefix = "train/time/"
    actor_steps = {r["step"]: {k[len(prefix):]: v for k, v in r.items() if k.startswith(prefix)}
                   for r in read_jsonl(os.path.join(actor_dir, "metrics.jsonl"), allow_non_finite=True) if prefix + "step" in r}
    # The critic logs its busy seconds with each critic_train call: one per PPO step, in order.
    server = [r for r in read_jsonl(os.path.join(critic_dir, "metrics.jsonl"), allow_non_finite=True) if "critic/time/train" in r]
    if len(server) != len(actor_steps):
        raise SystemExit(f"{len(actor_steps)} actor steps but {len(server)} critic_train calls logged")
    for step, busy in zip(sorted(actor_steps), server):
        actor_steps[step]["server_infer"] = busy["critic/time/infer"]
        actor_steps[step]["server_train"] = busy["critic/time/train"]
    timed = [actor_steps[s] for s in sorted(actor_steps)[1:]]  # the first step includes start-up work
    phases = {k: statistics.median(t.get(k, 0.0) for t in timed) for k in timed[0]}
    waits = phases.get("critic_infer_wait", 0.0) + phases.get("critic_train_wait", 0.0)
    busy = phases["server_infer"] + phases["server_train"]
    serial = phases["step"] - waits + busy
    row = {"shape": args.shape, "rollouts": args.rollouts, "rollout_micro_batch": args.rollout_micro_batch,
           "micro_batch": args.micro_batch, "new_tokens": args.new_tokens, "step_s": phases["step"],
           "serial_step_s": serial, "ratio": phases["step"] / serial,
           "hidden_share": 1.0 - waits / busy if busy > 0 else float("nan"), "phases_s": phases,
           "steps": timed}
    print(f"\nPPO step, {args.rollouts} rollouts ({args.rollout_micro_batch} per generate call), "
          f"{args.new_tokens} new tokens, {args.shape} model, fp32, actor and critic server each with "
          f"{torch.get_num_threads()} threads on this machine ({cpu_model()}); medians over {len(timed)} steps")
    print("| phase | seconds per step |\n|---|---|")
    for name, seconds in phases.items():
        if name != "step":
            print(f"| {name} | {seconds:.3f} |")
    print(f"| **step (measured)** | **{phases['step']:.3f}** |")
    print(f"| serial (step - waits + server busy) | {serial:.3f} |")
    print(f"ratio measured / serial {row['ratio']:.2f}; the actor waited for {waits:.3f} s of the server's "
          f"{busy:.3f} s busy time (hidden share {row['hidden_share']:.0%})")
    payload = {"benchmark": "ppo", "machine": machine(), "args": vars(args), "rows": [row]}
    print("written", write_json("ppo", payload))
    return payload


if __name__ == "__main__":
    main()
