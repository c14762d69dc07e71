"""SteerLM 2.0: train a SteerLM model on its own sampled responses, importance-weighted towards
P(y|a,x) ~ P(a|x,y) P(y|x) (NeMo-Aligner's train_steerlm2.py command line, on gpt_sft.yaml). The
records come from examples/nlp/data/steerlm/generate_steerlm2_data.py; run both again with the
trained model for another iteration.

    python examples/nlp/gpt/train_steerlm2.py model.restore_from_path=steerlm.nemo model.data.chat=True \
        model.data.train_ds.file_path=steerlm2_train.jsonl model.data.validation_ds.file_path=steerlm2_val.jsonl \
        model.data.train_ds.global_batch_size=16 model.steerlm2.micro_batch_size=16 \
        model.steerlm2.forward_micro_batch_size=16 exp_manager.explicit_log_dir=results/steerlm2
"""

from nemo_aligner.recipes.steerlm2 import run_steerlm2
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_sft")
def main(cfg):
    return run_steerlm2(cfg)


if __name__ == "__main__":
    main()
