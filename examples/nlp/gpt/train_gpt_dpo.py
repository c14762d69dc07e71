"""DPO / IPO / RPO training (NeMo-Aligner's train_gpt_dpo.py command line).

    python examples/nlp/gpt/train_gpt_dpo.py pretrained_checkpoint.restore_from_path=sft.nemo \
        "model.data.data_prefix={train: [dpo_train.jsonl], validation: [dpo_val.jsonl], test: [dpo_val.jsonl]}" \
        model.dpo.ref_policy_kl_penalty=0.1 exp_manager.explicit_log_dir=results/dpo
"""

from nemo_aligner.recipes.dpo import run_dpo
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_dpo")
def main(cfg):
    return run_dpo(cfg)


if __name__ == "__main__":
    main()
