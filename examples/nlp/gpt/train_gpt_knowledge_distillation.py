"""Knowledge distillation from a teacher's precomputed top-k logits (NeMo-Aligner's
train_gpt_knowledge_distillation.py command line). The records come from
examples/nlp/synthetic_data_gen/compute_topk_logits.py.

    python examples/nlp/gpt/train_gpt_knowledge_distillation.py pretrained_checkpoint.restore_from_path=student.nemo \
        "model.data.data_prefix={train: [kd/train_topk.jsonl], validation: [kd/val_topk.jsonl]}" \
        model.knowledge_distillation.kd_loss=fwd_kl exp_manager.explicit_log_dir=results/kd
"""

from nemo_aligner.recipes.knowledge_distillation import run_knowledge_distillation
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_knowledge_distillation")
def main(cfg):
    return run_knowledge_distillation(cfg)


if __name__ == "__main__":
    main()
