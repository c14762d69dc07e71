"""GRPO: groups of generations per prompt, group-normalised advantages, KL to the reference in the
loss; rewards from a Python function (reward_fn) or a reward-model server (remote_rm).

    python examples/nlp/gpt/train_gpt_grpo.py pretrained_checkpoint.restore_from_path=sft.nemo \
        "++model.data.data_prefix={train: [prompts_train.jsonl], validation: [prompts_val.jsonl]}" \
        reward_fn=nemo_aligner.data.nlp.builtin_task:reward exp_manager.explicit_log_dir=results/grpo
"""

from nemo_aligner.recipes.grpo import run_grpo
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_grpo")
def main(cfg):
    return run_grpo(cfg)


if __name__ == "__main__":
    main()
