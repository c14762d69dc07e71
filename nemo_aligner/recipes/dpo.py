"""DPO (and IPO, RPO) end to end from a Hydra config (NeMo-Aligner's train_gpt_dpo.py)."""

from __future__ import annotations

from functools import partial
from typing import Dict

from omegaconf import DictConfig

from nemo_aligner.recipes.offline_preference import run_offline_preference
from nemo_aligner.recipes.prepare_packed import check_packed_attention
from nemo_aligner.recipes.run_helpers import report_finished
from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset, collate_dpo
from nemo_aligner.data.nlp.packing import PackedDataset, collate_packs
from nemo_aligner.models.nlp.gpt.megatron_gpt_dpo_model import MegatronGPTDPOModel


def run_dpo(cfg: DictConfig, callbacks=None) -> Dict[str, float]:
    """Train ``pretrained_checkpoint.restore_from_path`` on preference pairs; the reference is its start."""
    data_cfg = cfg.model.data

    packed = data_cfg.get("data_impl") == "packed_jsonl"

    def make_dataset(paths, model, seq, key):
        if packed:  # NeMo-Aligner's packs of pairs (prepare_packed_dpo_dataset.py)
            check_packed_attention(model, "model.data.data_impl=packed_jsonl")
            return PackedDataset(paths, "dpo", seq, model.tokenizer.vocab_size, key)
        return DPOPairDataset(paths, model.tokenizer, seq, key=key,
                              default_chosen_reward=float(data_cfg.get("default_chosen_reward", 1.0)),
                              default_rejected_reward=float(data_cfg.get("default_rejected_reward", 0.0)),
                              add_eos=bool(data_cfg.get("append_eod", True)))

    def make_collate(model, seq):
        multiple = data_cfg.get("pad_length_to_multiple_of")
        if packed:
            return partial(collate_packs, pad_id=model.tokenizer.eos_id, max_length=seq,
                           pad_to_multiple_of=multiple or 16)
        return partial(collate_dpo, pad_id=model.tokenizer.eos_id, seq_length=seq, pad_to_multiple_of=multiple or 8)

    summary, trainer, model = run_offline_preference(cfg, "dpo", MegatronGPTDPOModel, make_dataset, make_collate,
                                                     "prompt/chosen_response/rejected_response", callbacks,
                                                     packed_data=packed)
    summary["val_accuracy"] = trainer.last_val_metrics.get("accuracy", float("nan"))
    summary["val_reward_margin"] = trainer.last_val_metrics.get("reward_margin", float("nan"))
    report_finished(summary, f"DPO ({model.loss_kind}) finished: {summary['steps']} steps, train loss "
                             f"{summary['final_train_loss']:.4f}, validation loss {summary['final_val_loss']:.4f}, "
                             f"preference accuracy {summary['val_accuracy']:.3f}, reward margin "
                             f"{summary['val_reward_margin']:.3f}")
    return summary
