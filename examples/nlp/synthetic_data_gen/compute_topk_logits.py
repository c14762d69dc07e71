"""A teacher's top-k logits over SFT data, for knowledge distillation (NeMo-Aligner's
compute_topk_logits.py command line). Resumable: run it again and it continues where it stopped.

    python examples/nlp/synthetic_data_gen/compute_topk_logits.py \
        pretrained_checkpoint.restore_from_path=teacher.nemo data.data.file_path=sft_train.jsonl \
        output_path=kd/train_topk.jsonl top_k=4
"""

from nemo_aligner.recipes.compute_topk_logits import run_compute_topk_logits
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="compute_topk_logits")
def main(cfg):
    return run_compute_topk_logits(cfg)


if __name__ == "__main__":
    main()
