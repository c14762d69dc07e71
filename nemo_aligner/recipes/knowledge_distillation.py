"""Knowledge distillation end to end from a Hydra config (NeMo-Aligner's
``train_gpt_knowledge_distillation.py``): the student from ``pretrained_checkpoint.restore_from_path``,
records of ``compute_topk_logits.py`` from ``model.data.data_prefix``, SupervisedTrainer."""

from __future__ import annotations

import logging
from collections import Counter
from functools import partial
from typing import Dict

from omegaconf import DictConfig

from nemo_aligner.data.nlp.kd_dataset import KnowledgeDistillationDataset, collate_kd
from nemo_aligner.models.nlp.gpt.megatron_gpt_knowledge_distillation import MegatronGPTKnowledgeDistillationModel
from nemo_aligner.recipes.offline_preference import run_offline_preference
from nemo_aligner.recipes.run_helpers import report_finished
from nemo_aligner.utils.errors import ConfigError

NAME = "knowledge_distillation"
logger = logging.getLogger(__name__)


def check_chunk_sizes(records, expected, split: str) -> None:
    """``model.data.n_examples_per_chunk`` (a number, or one per split) against the chunks' records:
    every record is read either way; a chunk of another size gets a warning naming it."""
    if hasattr(expected, "get"):
        expected = expected.get(split)
    if expected is None:
        return
    counts = Counter(r.get("__file__") for r in records)
    for path, count in counts.items():
        if count != int(expected):
            logger.warning("%s: %d records; model.data.n_examples_per_chunk says %s (all %d are used)", path, count,
                           expected, count)


def run_knowledge_distillation(cfg: DictConfig, callbacks=None) -> Dict[str, float]:
    """Train the student ``pretrained_checkpoint.restore_from_path`` towards the teacher's top-k logits."""
    data_cfg = cfg.model.data
    top_k = data_cfg.get("top_k")
    if top_k is not None and int(top_k) < 1:
        raise ConfigError(f"model.data.top_k={top_k} must be >= 1 (or null: every logit in the records)")

    def make_dataset(paths, model, seq, key):
        dataset = KnowledgeDistillationDataset(paths, model.tokenizer.vocab_size, seq, top_k, key=key)
        if data_cfg.get("data_impl") == "chunked_jsonl":
            check_chunk_sizes(dataset.records, data_cfg.get("n_examples_per_chunk"), key.rsplit(".", 1)[-1])
        return dataset

    def make_collate(model, seq):
        return partial(collate_kd, pad_id=model.tokenizer.eos_id, pad_to_multiple_of=data_cfg.get("pad_to_multiple_of", 8))

    summary, trainer, model = run_offline_preference(cfg, NAME, MegatronGPTKnowledgeDistillationModel, make_dataset,
                                                     make_collate, "records of compute_topk_logits.py", callbacks,
                                                     checkpoint_holds="the student .nemo", chunked_data=True)
    summary["val_kd_loss"] = trainer.last_val_metrics.get("kd_loss", float("nan"))
    report_finished(summary, f"Knowledge distillation finished: {summary['steps']} steps, train loss "
                             f"{summary['final_train_loss']:.4f}, validation loss {summary['final_val_loss']:.4f} "
                             f"(KL to the teacher {summary['val_kd_loss']:.4f})")
    return summary
