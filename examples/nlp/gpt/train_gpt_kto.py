"""KTO training from unpaired desirable/undesirable responses.

    python examples/nlp/gpt/train_gpt_kto.py pretrained_checkpoint.restore_from_path=sft.nemo \
        "++model.data.data_prefix={train: [kto_train.jsonl], validation: [kto_val.jsonl]}" \
        model.kto.ref_policy_kl_penalty=0.1 exp_manager.explicit_log_dir=results/kto
"""

from nemo_aligner.recipes.kto import run_kto
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_kto")
def main(cfg):
    return run_kto(cfg)


if __name__ == "__main__":
    main()
