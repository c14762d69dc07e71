"""SteerLM 2.0 training end to end from a Hydra config (NeMo-Aligner's ``train_steerlm2.py`` on
``gpt_sft.yaml``): the SteerLM model from ``model.restore_from_path``, records of sampled responses
with their log-probabilities from ``model.data.{train_ds,validation_ds}.file_path``."""

from __future__ import annotations

from functools import partial
from typing import Dict

from omegaconf import DictConfig

from nemo_aligner.data.nlp.builders import _records
from nemo_aligner.data.nlp.steerlm2_dataset import SteerLM2Dataset, collate_steerlm2
from nemo_aligner.models.nlp.gpt.gpt_steerlm2_model import GPTSteerLM2Model
from nemo_aligner.recipes.sft import run_sft


def run_steerlm2(cfg: DictConfig, callbacks=None) -> Dict[str, float]:
    """One SteerLM 2.0 iteration: train on the records; sample new ones with the result for the next."""
    data_cfg = cfg.model.data
    tokens = data_cfg.get("chat_prompt_tokens")

    def build_dataset(ds_cfg, model, seq, key):
        records, name = _records(ds_cfg.get("file_path") or ds_cfg.get("file_names"), key)
        limit = min(int(ds_cfg.get("max_seq_length") or seq), seq)
        return SteerLM2Dataset(records, model.tokenizer, limit, tokens, name=name)

    def make_collate(model, seq):
        return partial(collate_steerlm2, pad_id=model.tokenizer.eos_id,
                       pad_to_multiple_of=data_cfg.get("pad_to_multiple_of", 8))

    return run_sft(cfg, callbacks, model_cls=GPTSteerLM2Model, build_dataset=build_dataset, make_collate=make_collate,
                   what="SteerLM 2.0")
