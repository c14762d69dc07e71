"""Train a reward model (NeMo-Aligner's train_reward_model.py command line).

    python examples/nlp/gpt/train_reward_model.py \
        pretrained_checkpoint.restore_from_path=sft.nemo ++model.data.data_impl=jsonl \
        "++model.data.data_prefix={train: [train_comparisons.jsonl], validation: [val_comparisons.jsonl], test: [val_comparisons.jsonl]}" \
        exp_manager.explicit_log_dir=results/rm
"""

from nemo_aligner.recipes.reward_model import run_reward_model
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="training_rm")
def main(cfg):
    return run_reward_model(cfg)


if __name__ == "__main__":
    main()
