"""REINFORCE / RLOO actor: several responses per prompt, leave-one-out baseline, KL to the initial
policy; rewards from a reward-model server (remote_rm) or a Python function (reward_fn).

    python examples/nlp/gpt/train_gpt_reinforce_actor.py pretrained_checkpoint.restore_from_path=sft.nemo \
        "++model.data.data_prefix={train: [prompts_train.jsonl], validation: [prompts_val.jsonl]}" \
        reward_fn=nemo_aligner.data.nlp.builtin_task:reward exp_manager.explicit_log_dir=results/reinforce
"""

from nemo_aligner.recipes.reinforce import run_reinforce_actor
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_reinforce_actor")
def main(cfg):
    return run_reinforce_actor(cfg)


if __name__ == "__main__":
    main()
