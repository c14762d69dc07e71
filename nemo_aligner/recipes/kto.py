"""KTO end to end from a Hydra config (``train_gpt_kto.py``)."""

from __future__ import annotations

from functools import partial
from typing import Dict

from omegaconf import DictConfig

from nemo_aligner.recipes.offline_preference import run_offline_preference
from nemo_aligner.recipes.run_helpers import report_finished
from nemo_aligner.data.nlp.kto_dataset import KTODataset, collate_kto
from nemo_aligner.models.nlp.gpt.megatron_gpt_kto_model import MegatronGPTKTOModel


def run_kto(cfg: DictConfig) -> Dict[str, float]:
    """Train ``pretrained_checkpoint.restore_from_path`` on desirable/undesirable responses."""
    data_cfg = cfg.model.data

    def make_dataset(paths, model, seq, key):
        return KTODataset(paths, model.tokenizer, seq, key=key, add_eos=bool(data_cfg.get("append_eod", True)))

    def make_collate(model, seq):
        return partial(collate_kto, tokenizer=model.tokenizer, seq_length=seq,
                       pad_to_multiple_of=data_cfg.get("pad_length_to_multiple_of") or 8)

    summary, trainer, _ = run_offline_preference(cfg, "kto", MegatronGPTKTOModel, make_dataset, make_collate,
                                                 "prompt/response/preference")
    summary["val_reward_margin"] = trainer.last_val_metrics.get("reward_margin", float("nan"))
    report_finished(summary, f"KTO finished: {summary['steps']} steps, train loss {summary['final_train_loss']:.4f}, "
                             f"validation loss {summary['final_val_loss']:.4f}, desirable-minus-undesirable reward "
                             f"{summary['val_reward_margin']:.3f}")
    return summary
