"""SteerLM attribute-conditioned SFT (NeMo chat data with per-turn "label" attribute strings).

    python examples/nlp/gpt/train_steerlm_model.py model.restore_from_path=sft.nemo \
        model.data.train_ds.file_path=steerlm_train.jsonl model.data.validation_ds.file_path=steerlm_val.jsonl \
        exp_manager.explicit_log_dir=results/steerlm
"""

from nemo_aligner.recipes.steerlm import run_steerlm
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_steerlm")
def main(cfg):
    return run_steerlm(cfg)


if __name__ == "__main__":
    main()
