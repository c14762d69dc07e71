"""``make demo``: the built-in task end to end on a tiny model, on the CPU, in about 36 minutes.

Writes the built-in data, then runs each stage as a user would: SFT of a randomly initialised
tiny GPT (the policy), and a longer SFT run the reward model starts from; the SFT policy sampled
(``generate_gpt.py``) and its answers scored by the task's rule, with generated right and wrong
answers, into regression reward-model data; the reward model; a reward-model server queried by a
client; PPO (critic server + actor), DPO and REINFORCE/RLOO from
the SFT model (all with their Hydra scripts); GRPO and rejection sampling through the Python API.
Every final policy is scored on held-out prompts by the task's rule and by the reward model; prints
a summary table and writes ``report.png`` with the curves and both scores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Sequence

from nemo_aligner.data.nlp.builtin_task import BuiltinTask
from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.utils.checkpoint_io import recover_replaced_dir, remove_dir_atomically
from nemo_aligner.utils.examples_path import examples_dir

SCRIPTS = examples_dir("nlp", "gpt")


def remove_stage_dir(path: str) -> None:
    """A stage starts fresh (metrics.jsonl appends); a kill while this deletes the last run's stage
    leaves a ``.removing`` directory, never a half-deleted checkpoint under its own name."""
    recover_replaced_dir(path)
    if os.path.isdir(path):
        remove_dir_atomically(path)


def tiny_optim(lr: float, min_lr: float, warmup_steps: int) -> list:
    """The optimizer settings of a built-in tiny-model stage. The scripts' defaults are NeMo-Aligner's,
    for pretrained billion-parameter models (SFT at lr 3e-5, actors at 9e-7): a 2-layer model trained
    from scratch in a few hundred steps needs rates 10-30x higher and a cosine over the whole run."""
    return [f"model.optim.lr={lr}", f"model.optim.sched.min_lr={min_lr}",
            f"model.optim.sched.warmup_steps={warmup_steps}", "model.optim.sched.constant_steps=0",
            "model.optim.weight_decay=0.01"]


# The batch sizes of the built-in tiny-model runs, for the scripts whose defaults (NeMo-Aligner's:
# global batches of 64-128 in micro-batches of 1, 512 rollout prompts) are made for billion-parameter
# models on a cluster. A stage's own overrides come after these and win.
TINY_BATCH = {
    "train_gpt_sft.py": ("model.data.train_ds.global_batch_size=32", "model.data.train_ds.micro_batch_size=8"),
    "train_gpt_dpo.py": ("model.global_batch_size=32", "model.micro_batch_size=4"),
    "train_gpt_kto.py": ("model.global_batch_size=32", "model.micro_batch_size=8"),
    "train_reward_model.py": ("model.global_batch_size=32",),
    "serve_ppo_critic.py": ("model.global_batch_size=32", "model.micro_batch_size=4"),
    "train_gpt_reinforce_actor.py": ("model.reinforce.num_rollout_samples=128",),
}
# SteerLM's scripts read gpt_sft.yaml's batch keys
TINY_BATCH["train_steerlm_model.py"] = TINY_BATCH["train_steerlm2.py"] = TINY_BATCH["train_gpt_sft.py"]


def tiny_batch(script: str) -> list:
    """The built-in tiny model's batch-size overrides for ``script`` (a file name; none for the others)."""
    return list(TINY_BATCH.get(os.path.basename(script), ()))


def run(script: str, overrides: list) -> None:
    cmd = [sys.executable, os.path.join(SCRIPTS, script)] + tiny_batch(script) + overrides
    print("\n$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def loss_table(metrics_path: str) -> list:
    """``(step, train loss, validation loss)`` at each validation."""
    train, rows = {}, []
    for record in read_jsonl(metrics_path, allow_non_finite=True):
        if "train/loss" in record:
            train[record["step"]] = record["train/loss"]
        if "val/loss" in record:
            rows.append((record["step"], train.get(record["step"]), record["val/loss"]))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default=os.path.join("results", "demo"))
    parser.add_argument("--sft-steps", type=int, default=150,
                        help="short on purpose: a partly trained policy leaves room for PPO and GRPO to improve it")
    parser.add_argument("--rm-backbone-steps", type=int, default=600,
                        help="SFT steps of the model the reward model starts from (a stronger model than the policy)")
    parser.add_argument("--rm-backbone-layers", type=int, default=4,
                        help="layers of the reward model (the policy has 2): a 2-layer reward model checks `reverse` "
                             "answers too poorly for PPO")
    parser.add_argument("--policy-samples", type=int, default=8,
                        help="SFT-policy answers per training prompt, scored by the task's rule for the reward model")
    parser.add_argument("--rm-steps", type=int, default=3000)
    parser.add_argument("--rm-batch-size", type=int, default=128,
                        help="the reward model's global batch (a smaller one trains a reward model PPO exploits)")
    parser.add_argument("--ppo-steps", type=int, default=800)
    parser.add_argument("--dpo-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=1000)
    parser.add_argument("--rloo-steps", type=int, default=1000)
    parser.add_argument("--rs-steps", type=int, default=600)
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out_dir)
    data = os.path.join(out, "data")
    paths = BuiltinTask(seed=0).write_all(data, n_train=2000, n_val=200)
    print(f"built-in data written to {data}")

    sft_nemo = sft_stage(out, paths, "sft", args.sft_steps)
    backbone = sft_stage(out, paths, "rm_backbone", args.rm_backbone_steps,
                         [f"model.num_layers={args.rm_backbone_layers}"])
    rm_train, rm_val = reward_model_data_stage(out, paths, sft_nemo, args.policy_samples)
    rm_nemo = reward_model_stage(out, backbone, rm_train, rm_val, args.rm_steps, args.rm_batch_size)
    serve_stage(rm_nemo)
    ppo_stage(out, paths, sft_nemo, rm_nemo, args.ppo_steps)
    dpo_stage(out, paths, sft_nemo, args.dpo_steps)
    rloo_stage(out, paths, sft_nemo, args.rloo_steps)
    grpo_stage(out, paths, sft_nemo, args.grpo_steps)
    rs_stage(out, paths, sft_nemo, args.rs_steps)
    report(out, policy_scores(out, paths["prompts_val"], rm_nemo))


def sft_stage(out: str, paths: dict, name: str, steps: int, overrides: Sequence[str] = ()) -> str:
    """SFT of a randomly initialised tiny GPT on the built-in task (``overrides``: more Hydra
    overrides); returns the .nemo."""
    sft_dir = os.path.join(out, name)
    remove_stage_dir(sft_dir)  # a fresh run each time (metrics.jsonl appends)
    run("train_gpt_sft.py", [
        f"model.data.train_ds.file_path={paths['sft_train']}",
        f"model.data.validation_ds.file_path={paths['sft_val']}",
        f"trainer.sft.max_steps={steps}",
        "trainer.sft.max_epochs=100",
        f"trainer.sft.val_check_interval={max(steps // 6, 1)}",
        f"exp_manager.explicit_log_dir={sft_dir}",
        "exp_manager.resume_if_exists=False",
        *tiny_optim(1e-3, 1e-4, 10),
        *overrides,
    ])
    rows = loss_table(os.path.join(sft_dir, "metrics.jsonl"))
    shape = "".join(f", {o}" for o in overrides)
    print(f"\nSFT on the built-in task (tiny GPT{shape}, random init), {steps} steps:")
    print(f"{'step':>6} {'train loss':>11} {'val loss':>9}")
    for step, train, val in rows:
        print(f"{step:>6} {train if train is not None else float('nan'):>11.4f} {val:>9.4f}")
    nemo = os.path.join(sft_dir, "checkpoints", "megatron_gpt_sft.nemo")
    print(f"\nvalidation loss {rows[0][2]:.3f} -> {rows[-1][2]:.3f}; fine-tuned model: {nemo}")
    return nemo


def series(records: list, key: str) -> tuple:
    points = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in points], [p[1] for p in points]


# The final policy of each stage (the SFT model is where every other stage starts), and its metrics directory.
POLICIES = (("SFT", os.path.join("sft", "checkpoints", "megatron_gpt_sft.nemo"), "sft"),
            ("PPO", os.path.join("ppo_actor", "checkpoints", "megatron_gpt_ppo_actor.nemo"), "ppo_actor"),
            ("DPO", os.path.join("dpo", "checkpoints", "megatron_gpt.nemo"), "dpo"),
            ("RLOO", os.path.join("rloo", "checkpoints", "megatron_gpt_reinforce_actor.nemo"), "rloo"),
            ("GRPO", os.path.join("grpo", "fit_1", "checkpoints", "megatron_gpt_grpo.nemo"), os.path.join("grpo", "fit_1")),
            ("RS", os.path.join("rs", "fit_1", "checkpoints", "megatron_gpt_rs_actor.nemo"), os.path.join("rs", "fit_1")))


def policy_scores(out: str, prompts_file: str, rm_nemo: str) -> dict:
    """``{stage: (task score, reward-model score)}``: each stage's greedy responses to the held-out
    prompts, scored by the task's rule and by the demo's reward model (means)."""
    from nemo_aligner.recipes.evaluate import greedy_responses, mean_reward, reward_model_scores

    prompts = [r["text"] for r in read_jsonl(prompts_file)]
    scores = {}
    for name, path, _ in POLICIES:
        responses = greedy_responses(os.path.join(out, path), prompts)
        rm = reward_model_scores(rm_nemo, [p + r for p, r in zip(prompts, responses)])
        scores[name] = (mean_reward(prompts, responses, BuiltinTask.score), sum(rm) / len(rm))
    return scores


def report(out: str, scores: dict) -> None:
    """The summary table, and ``report.png`` with every stage's curves and both scores of each
    stage's policy (:func:`policy_scores`)."""
    runs = {name: read_jsonl(os.path.join(out, d, "metrics.jsonl"), allow_non_finite=True) for name, _, d in POLICIES}
    runs["RM"] = read_jsonl(os.path.join(out, "rm", "metrics.jsonl"), allow_non_finite=True)
    first_last = lambda name, key: (series(runs[name], key)[1][0], series(runs[name], key)[1][-1])  # noqa: E731
    sft_task, sft_rm = scores["SFT"]
    half_gap = sft_task + (1.0 - sft_task) / 2
    rows = [("SFT validation loss", *first_last("SFT", "val/loss")),
            ("reward model squared error (held-out answers)", *first_last("RM", "val/mse")),
            ("DPO preference accuracy (held-out pairs)", *first_last("DPO", "val/accuracy"))]
    print("\n" + "=" * 72)
    print(f"{'training':<48} {'first':>10} {'last':>10}")
    print("-" * 72)
    for name, first, last in rows:
        print(f"{name:<48} {first:>10.3f} {last:>10.3f}")
    print("=" * 72)
    print("Final policies on the held-out prompts (greedy): the task's rule-based score (fraction of")
    print(f"right characters) and the reward model's score. Half the gap from SFT to perfect: {half_gap:.3f}.")
    print(f"{'policy':<8} {'task score':>11} {'change':>8} {'reward model':>13} {'change':>8}")
    print("-" * 72)
    for name, _, _ in POLICIES:
        task, rm = scores[name]
        change = "" if name == "SFT" else f"{task - sft_task:+8.3f}"
        rm_change = "" if name == "SFT" else f"{rm - sft_rm:+8.3f}"
        print(f"{name:<8} {task:>11.3f} {change:>8} {rm:>13.3f} {rm_change:>8}")
    print("=" * 72)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("SFT", "SFT", [("train/loss", "train loss"), ("val/loss", "validation loss")]),
              ("Reward model (regression)", "RM", [("train/loss", "train squared error"),
                                                   ("val/mse", "validation squared error")]),
              ("PPO (reward model)", "PPO", [("train/rewards", "train reward"), ("val/global_rewards", "validation reward")]),
              ("DPO (+ SFT loss on chosen)", "DPO", [("train/preference_loss", "train preference loss"),
                                                     ("val/accuracy", "validation accuracy")]),
              ("RLOO (task reward)", "RLOO", [("train/rewards", "train reward"), ("val/global_rewards", "validation reward")]),
              ("GRPO (task reward, Python API)", "GRPO",
               [("train/rewards", "train reward"), ("val/global_rewards", "validation reward")]),
              ("RS (task reward, Python API)", "RS",
               [("train/rewards", "train reward"), ("val/global_rewards", "validation reward")])]
    fig, axes = plt.subplots(3, 3, figsize=(13, 10))
    axes = axes.ravel()
    for ax, (title, name, keys) in zip(axes, panels):
        for key, label in keys:
            x, y = series(runs[name], key)
            ax.plot(x, y, marker="o" if len(x) < 12 else None, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    names = [name for name, _, _ in POLICIES]
    colors = ["gray"] + ["tab:blue"] * (len(names) - 1)
    for ax, column, title in ((axes[-2], 0, "Task score (rule, greedy, held-out)"),
                              (axes[-1], 1, "Reward-model score (greedy, held-out)")):
        ax.bar(names, [scores[n][column] for n in names], color=colors)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[-2].set_ylim(0, 1)
    axes[-2].axhline(half_gap, color="tab:red", linestyle="--", linewidth=1, label="half the gap from SFT to 1")
    axes[-2].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = os.path.join(out, "report.png")
    fig.savefig(path + ".tmp.png", dpi=100)
    os.replace(path + ".tmp.png", path)
    plt.close(fig)
    print(f"training curves and scores: {path}")


# The RL stages' learning rate decays along a cosine to 1e-5: at a constant rate the held-out score
# rose to ~0.87 and then swung by +-0.03 between validations, so where a run stopped decided its result.
COSINE_TO_1E_5 = {"model.optim.sched.name": "CosineAnnealing", "model.optim.sched.min_lr": 1e-5,
                  "model.optim.sched.warmup_steps": 0, "model.optim.sched.constant_steps": 0}


def grpo_stage(out: str, paths: dict, sft_nemo: str, steps: int) -> None:
    """GRPO from the SFT model through the Python API, rewarded by the task's own scorer."""
    from nemo_aligner import GRPOTrainer
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask as Task

    grpo_dir = os.path.join(out, "grpo")
    remove_stage_dir(grpo_dir)
    print("\n>>> GRPOTrainer.from_pretrained(sft_nemo, num_prompts_per_step=16, num_generations_per_prompt=8, "
          "learning_rate=1.5e-4, overrides=COSINE_TO_1E_5).fit(dataset=prompts_train.jsonl, reward_fn=task.score)",
          flush=True)
    trainer = GRPOTrainer.from_pretrained(sft_nemo, num_prompts_per_step=16, num_generations_per_prompt=8,
                                          learning_rate=1.5e-4, max_sequence_length=64, max_new_tokens=9,
                                          global_batch_size=64, micro_batch_size=64, output_dir=grpo_dir,
                                          val_period=max(steps // 8, 1), overrides=COSINE_TO_1E_5)
    result = trainer.fit(dataset=paths["prompts_train"], val_dataset=paths["prompts_val"],
                         reward_fn=Task.score, max_steps=steps)
    print(f"GRPO: {result.total_steps} steps; validation reward {result.metrics['final_val_reward']:.3f}; "
          f"policy: {result.model_path}")


def rs_stage(out: str, paths: dict, sft_nemo: str, steps: int) -> None:
    """Rejection sampling from the SFT model through the Python API: the best of 8 answers to each
    prompt (by the task's scorer) is trained on."""
    from nemo_aligner import RejectionSamplingTrainer
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask as Task

    rs_dir = os.path.join(out, "rs")
    remove_stage_dir(rs_dir)
    print("\n>>> RejectionSamplingTrainer.from_pretrained(sft_nemo, num_prompts_per_step=64, "
          "num_rollouts_per_prompt=8, top_n_rollouts=1, learning_rate=2e-4).fit(dataset=prompts_train.jsonl, "
          "reward_fn=task.score)", flush=True)
    trainer = RejectionSamplingTrainer.from_pretrained(sft_nemo, num_prompts_per_step=64, num_rollouts_per_prompt=8,
                                                       top_n_rollouts=1, learning_rate=2e-4, max_sequence_length=64,
                                                       max_new_tokens=9, global_batch_size=64, micro_batch_size=64,
                                                       output_dir=rs_dir, val_period=max(steps // 5, 1))
    result = trainer.fit(dataset=paths["prompts_train"], val_dataset=paths["prompts_val"],
                         reward_fn=Task.score, max_steps=steps)
    print(f"RS: {result.total_steps} steps; validation reward {result.metrics['final_val_reward']:.3f}; "
          f"policy: {result.model_path}")


def rloo_stage(out: str, paths: dict, sft_nemo: str, steps: int) -> None:
    """REINFORCE with the leave-one-out baseline (RLOO) from the SFT model, rewarded by the task's
    scorer given as ``reward_fn``."""
    rloo_dir = os.path.join(out, "rloo")
    remove_stage_dir(rloo_dir)
    run("train_gpt_reinforce_actor.py", [
        f"pretrained_checkpoint.restore_from_path={sft_nemo}",
        f"++model.data.data_prefix={{train: [{paths['prompts_train']}], validation: [{paths['prompts_val']}]}}",
        "reward_fn=nemo_aligner.data.nlp.builtin_task:reward",
        f"trainer.reinforce.max_steps={steps}", "trainer.reinforce.max_epochs=100",
        f"trainer.reinforce.val_check_interval={max(steps // 8, 1)}", "trainer.reinforce.save_interval=0",
        "model.reinforce.num_rollout_samples=16", "model.reinforce.num_responses_per_prompt=8",
        "model.global_batch_size=64", "model.micro_batch_size=64", "model.reinforce.rollout_micro_batch_size=128",
        "model.reinforce.num_val_samples=200", "model.reinforce.length_params.max_length=9",
        "model.optim.lr=1.5e-4", *(f"{key}={value}" for key, value in COSINE_TO_1E_5.items()),
        "model.optim.weight_decay=0.01",
        f"exp_manager.explicit_log_dir={rloo_dir}", "exp_manager.resume_if_exists=False",
    ])


def dpo_stage(out: str, paths: dict, sft_nemo: str, steps: int) -> None:
    """DPO from the SFT model on the built-in preference pairs (the SFT model is the reference), with
    the SFT loss on the chosen responses added (``model.dpo.sft_loss_weight``, as Nemotron-4's DPO)."""
    dpo_dir = os.path.join(out, "dpo")
    remove_stage_dir(dpo_dir)
    run("train_gpt_dpo.py", [
        f"pretrained_checkpoint.restore_from_path={sft_nemo}",
        f"++model.data.data_prefix={{train: [{paths['dpo_train']}], validation: [{paths['dpo_val']}]}}",
        f"trainer.dpo.max_steps={steps}", "trainer.dpo.max_epochs=100",
        f"trainer.dpo.val_check_interval={max(steps // 3, 1)}", "model.dpo.ref_policy_kl_penalty=0.2",
        "model.dpo.sft_loss_weight=1.0", *tiny_optim(2e-4, 1e-5, 5), f"exp_manager.explicit_log_dir={dpo_dir}",
        "exp_manager.resume_if_exists=False",
    ])
    print("\nDPO (policy from the SFT model, reference = the SFT model), held-out pairs:")
    for record in read_jsonl(os.path.join(dpo_dir, "metrics.jsonl"), allow_non_finite=True):
        if "val/accuracy" in record:
            print(f"  step {record['step']:>4}: preference accuracy {record['val/accuracy']:.3f}, "
                  f"reward margin {record['val/reward_margin']:.3f}")
    print(f"  policy: {os.path.join(dpo_dir, 'checkpoints', 'megatron_gpt.nemo')}")


def ppo_stage(out: str, paths: dict, sft_nemo: str, rm_nemo: str, steps: int) -> None:
    """PPO: the critic server (reward model co-located) and the actor, started together."""
    from nemo_aligner.launchers.ppo_local import run as run_ppo

    critic_dir, actor_dir = os.path.join(out, "ppo_critic"), os.path.join(out, "ppo_actor")
    for d in (critic_dir, actor_dir):
        remove_stage_dir(d)
    print("\n$ python -m nemo_aligner.launchers.ppo_local --critic ... --actor ...", flush=True)
    code = run_ppo(
        [f"pretrained_checkpoint.restore_from_path={rm_nemo}", f"exp_manager.explicit_log_dir={critic_dir}",
         "model.global_batch_size=64", "model.micro_batch_size=64", "trainer.ppo.max_batch_size=128",
         *tiny_optim(3e-4, 1e-5, 5), "exp_manager.resume_if_exists=False"],
        [f"pretrained_checkpoint.restore_from_path={sft_nemo}",
         f"++model.data.data_prefix={{train: [{paths['prompts_train']}], validation: [{paths['prompts_val']}]}}",
         f"exp_manager.explicit_log_dir={actor_dir}", "exp_manager.resume_if_exists=False",
         f"trainer.ppo.max_steps={steps}", "trainer.ppo.max_epochs=100",
         f"trainer.ppo.val_check_interval={max(steps // 4, 1)}", "trainer.ppo.save_interval=0",
         "model.ppo.num_rollout_samples=128", "model.global_batch_size=64", "model.micro_batch_size=64",
         "model.ppo.rollout_micro_batch_size=128", "model.ppo.num_val_samples=64",
         "model.ppo.length_params.max_length=12", *tiny_optim(1e-4, 1e-6, 0), "trainer.ppo.critic_warmup_steps=3"],
        critic_log=os.path.join(out, "ppo_critic_server.log"))
    if code != 0:
        raise SystemExit(f"PPO failed (status {code}); critic log: {os.path.join(out, 'ppo_critic_server.log')}")
    rewards, val = [], {}
    for record in read_jsonl(os.path.join(actor_dir, "metrics.jsonl"), allow_non_finite=True):
        if "train/rewards" in record:
            rewards.append(record["train/rewards"])
        if "val/global_rewards" in record:
            val[record["step"]] = record["val/global_rewards"]
    print("\nPPO (actor from the SFT model, reward from the co-located reward model):")
    for step, value in sorted(val.items()):
        print(f"  step {step:>3}: validation reward {value:.3f}")
    print(f"  mean training reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")
    print(f"  actor: {os.path.join(actor_dir, 'checkpoints', 'megatron_gpt_ppo_actor.nemo')}")


def reward_model_data_stage(out: str, paths: dict, sft_nemo: str, samples: int) -> tuple:
    """Regression reward-model data that covers the policy's own answers: ``generate_gpt.py`` samples
    the SFT policy ``samples`` times per training prompt, and the task's rule scores each response
    (:meth:`BuiltinTask.labelled_score_records`); added to them, right and wrong answers of 20000
    generated prompts (:meth:`BuiltinTask.scored_records`). Returns the train and validation files."""
    from nemo_aligner.data.nlp.jsonl import write_jsonl

    work = os.path.join(out, "reward_model_data")
    os.makedirs(work, exist_ok=True)
    prompts = [r["text"] for r in read_jsonl(paths["prompts_train"])]
    repeated = os.path.join(work, "prompts_repeated.jsonl")
    write_jsonl(repeated, [{"prompt": p} for p in prompts for _ in range(samples)])
    sampled = os.path.join(work, "sft_samples.jsonl")
    run("generate_gpt.py", [f"gpt_model_file={sft_nemo}", f"prompts_file={repeated}", f"output_file={sampled}",
                            "inference.greedy=False", "inference.temperature=1.0", "inference.tokens_to_generate=9",
                            "inference.seed=1", "batch_size=256"])
    labelled = BuiltinTask.labelled_score_records(list(read_jsonl(sampled)))
    task = BuiltinTask(seed=0)
    generated = task.scored_records(20000, "train")
    train, val = os.path.join(work, "scored_train.jsonl"), os.path.join(work, "scored_val.jsonl")
    write_jsonl(train, labelled + generated)
    write_jsonl(val, task.scored_records(200, "val"))
    print(f"reward-model data: {len(labelled)} SFT-policy responses and {len(generated)} generated answers, "
          f"each labelled 4 x the task's score: {train}")
    return train, val


def reward_model_stage(out: str, backbone_nemo: str, rm_train: str, rm_val: str, steps: int, batch: int) -> str:
    """A regression reward model (one output: the predicted 4 x score) from ``backbone_nemo``."""
    rm_dir = os.path.join(out, "rm")
    remove_stage_dir(rm_dir)
    run("train_reward_model.py", [
        f"pretrained_checkpoint.restore_from_path={backbone_nemo}",
        "model.reward_model_type=regression",
        "++model.data.data_impl=jsonl",
        f"++model.data.data_prefix={{train: [{rm_train}], validation: [{rm_val}]}}",
        f"trainer.rm.max_steps={steps}", "trainer.rm.max_epochs=100",
        f"model.micro_batch_size={batch}", f"model.global_batch_size={batch}",
        f"trainer.rm.val_check_interval={max(steps // 4, 1)}", *tiny_optim(3e-4, 3e-5, 10),
        f"exp_manager.explicit_log_dir={rm_dir}", "exp_manager.resume_if_exists=False",
    ])
    print("\nReward model (regression on 4 x the task's score), held-out mean squared error:")
    for record in read_jsonl(os.path.join(rm_dir, "metrics.jsonl"), allow_non_finite=True):
        if "val/mse" in record:
            print(f"  step {record['step']:>4}: {record['val/mse']:.3f}")
    return os.path.join(rm_dir, "checkpoints", "megatron_gpt.nemo")


def serve_stage(rm_nemo: str) -> None:
    """Start the reward-model server, score right and wrong answers with the client, stop it."""
    import signal
    import socket
    import tempfile
    import time

    from nemo_aligner.servers.clients import RemoteGPTRMClient
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, os.path.join(SCRIPTS, "serve_reward_model.py"), f"rm_model_file={rm_nemo}",
           f"inference.port={port}", f"inference.grpc_port={port + 1 if port < 65000 else port - 1}",
           f"inference.metrics_port={port + 2 if port < 65000 else port - 2}"]
    print("\n$ " + " ".join(cmd[1:]), flush=True)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while "server ready" not in open(log.name).read():
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError("the reward-model server did not start:\n" + open(log.name).read()[-3000:])
            time.sleep(0.5)
        task = BuiltinTask(seed=123)
        examples = task.examples(4, "demo")
        texts, rows = [], []
        import random

        rng = random.Random(0)
        for inp, answer in examples:
            wrong = task.corrupt(answer, rng)
            prompt = task.prompt_text(inp)
            texts += [prompt + answer, prompt + wrong]
            rows.append((prompt, answer, wrong))
        with RemoteGPTRMClient("127.0.0.1", port, tokenizer=ByteTokenizer(), timeout_s=60) as client:
            rewards = client.infer_texts(texts).result()
        print(f"\nRewards from the server at 127.0.0.1:{port}:")
        print(f"  {'prompt':<18} {'right':<10} {'reward':>7}   {'wrong':<10} {'reward':>7}")
        for i, (prompt, answer, wrong) in enumerate(rows):
            print(f"  {prompt:<18} {answer:<10} {rewards[2 * i]:>7.2f}   {wrong:<10} {rewards[2 * i + 1]:>7.2f}")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        os.unlink(log.name)
    print("server stopped")


if __name__ == "__main__":
    main()
