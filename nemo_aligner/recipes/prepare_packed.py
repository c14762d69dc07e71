"""Packed datasets from jsonl, with NeMo's command lines: ``prepare_packed_ft_dataset.py`` (SFT) and
NeMo-Aligner's ``prepare_packed_dpo_dataset.py`` (DPO pairs). Samples are tokenized and truncated by the
same dataset classes training uses, then packed (``nemo_aligner.data.nlp.packing``); one
``<output_dir>/packed_{pack_size}_seed{seed}.npy`` per pack size."""

from __future__ import annotations

import logging
import os
from typing import List

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.data.nlp import packing
from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)

# keys the scripts take as ``+key=value`` beyond the training config they read
PACKING_KEYS = ("output_dir", "pack_sizes", "packing_algorithm", "tokenizer_path", "tokenizer_type", "seed")


def check_packed_attention(model, key: str) -> None:
    """Packs need the local layer spec: its attention reads the block-diagonal mask; Transformer Engine's
    causal kernels would ignore it and attend across samples."""
    from nemo_aligner.models.nlp.gpt.gpt_builder import uses_te_spec

    if uses_te_spec(model.cfg):
        raise ConfigError(f"{key}: packed sequences run on megatron-core's local layer spec (a block-diagonal "
                          "attention mask); set model.force_local_spec=True (Transformer Engine's THD attention "
                          "is not used here)")


def _tokenizer(cfg: DictConfig):
    """``+tokenizer_path`` (a .nemo, a SentencePiece model, a Hugging Face directory or name), else
    ``model.restore_from_path``'s tokenizer, else ``model.tokenizer`` (the built-in one by default)."""
    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.tokenizers import build_tokenizer

    path = cfg.get("tokenizer_path")
    if path:
        return nemo_file.tokenizer_from_path(path, cfg.get("tokenizer_type"))
    restore = cfg.model.get("restore_from_path")
    if restore:
        return nemo_file.load_tokenizer(str(restore), "model.restore_from_path")
    return build_tokenizer(cfg.model.get("tokenizer"))


def _settings(cfg: DictConfig):
    if not cfg.get("output_dir"):
        raise ConfigError("+output_dir=... is required (where the packed .npy files go)")
    sizes = cfg.get("pack_sizes")
    sizes = [sizes] if isinstance(sizes, int) else list(sizes or [])
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 2 for s in sizes):
        raise ConfigError(f"+pack_sizes={sizes} must be a list of token counts, e.g. [2048,4096]")
    algorithm = str(cfg.get("packing_algorithm") or "first_fit_shuffle")
    if algorithm not in packing.PACKING_ALGORITHMS:
        raise ConfigError(f"+packing_algorithm={algorithm!r} is not one of {', '.join(packing.PACKING_ALGORITHMS)}")
    return str(cfg.output_dir), sizes, algorithm


def _pack_and_write(samples: list, longest: int, too_long: str, pack, per_record: int, cfg: DictConfig,
                    seed: int) -> List[str]:
    """``pack(samples, size, algorithm, seed)`` for each ``+pack_sizes`` entry, written as
    ``packed_{size}_seed{seed}.npy``; a size below ``longest`` tokens is refused (``too_long`` says why)."""
    output_dir, sizes, algorithm = _settings(cfg)
    for size in sizes:
        if size < longest:
            raise ConfigError(f"+pack_sizes: {size} is shorter than {too_long} ({longest} tokens)")
    paths = []
    for size in sizes:
        records = pack(samples, size, algorithm, seed)
        path = packing.save_packed_records(os.path.join(output_dir, f"packed_{size}_seed{seed}.npy"), records)
        logger.info("%s: %s", path, packing.packing_report(records, size, per_record))
        print(f"wrote {path}: {packing.packing_report(records, size, per_record)}")
        paths.append(path)
    return paths


def run_prepare_packed_sft(cfg: DictConfig) -> List[str]:
    """Pack ``model.data.train_ds`` (``file_names`` or ``file_path``, cut to its ``max_seq_length``)."""
    from nemo_aligner.data.nlp.builders import build_sft_dataset

    _settings(cfg)  # checked before the data is read
    seed = int(cfg.get("seed", 0) or 0)
    tokenizer = _tokenizer(cfg)
    ds_cfg = OmegaConf.merge(cfg.model.data.train_ds, {"packed_sequence": False})
    seq = int(ds_cfg.get("max_seq_length") or cfg.model.get("encoder_seq_length") or 2048)
    dataset = build_sft_dataset(ds_cfg, tokenizer, seq, bool(cfg.model.data.get("chat", False)),
                                bool(cfg.model.get("answer_only_loss", True)), cfg.model.data.get("chat_prompt_tokens"))
    samples = []
    for i in range(len(dataset)):
        s = dataset[i]
        ids = list(s["input_ids"])
        mask = s.get("target_mask") or [idx >= int(s.get("answer_start", 0)) for idx in range(len(ids))]
        samples.append({"input_ids": ids, "loss_mask": [bool(m) for m in mask]})
    return _pack_and_write(samples, max(len(s["input_ids"]) for s in samples),
                           "the longest sample after truncation to model.data.train_ds.max_seq_length",
                           packing.pack_sft_samples, 1, cfg, seed)


def run_prepare_packed_dpo(cfg: DictConfig) -> List[str]:
    """Pack the pairs of ``model.data.data_prefix`` (a jsonl, or its ``train`` split), each pair cut to
    ``model.data.seq_length`` (``model.encoder_seq_length``) per response as DPO training cuts them."""
    from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset

    _settings(cfg)
    seed = int(cfg.model.get("seed", 1234) if cfg.get("seed") is None else cfg.seed)
    tokenizer = _tokenizer(cfg)
    data_cfg = cfg.model.data
    prefix = data_cfg.get("data_prefix")
    paths = prefix.get("train") if hasattr(prefix, "get") else prefix
    if not paths:
        raise ConfigError("model.data.data_prefix is required: the DPO jsonl to pack (or {train: [...]})")
    paths = [str(paths)] if isinstance(paths, str) else [str(p) for p in paths]
    seq = int(data_cfg.get("seq_length") or cfg.model.encoder_seq_length)
    dataset = DPOPairDataset(paths, tokenizer, seq, key="model.data.data_prefix",
                             default_chosen_reward=float(data_cfg.get("default_chosen_reward", 1.0)),
                             default_rejected_reward=float(data_cfg.get("default_rejected_reward", 0.0)),
                             add_eos=bool(data_cfg.get("append_eod", True)))
    samples = [dataset[i] for i in range(len(dataset))]
    return _pack_and_write(samples, max(len(s["chosen"]) + len(s["rejected"]) for s in samples),
                           "the longest pair, chosen and rejected together (use at least twice model.data.seq_length)",
                           packing.pack_dpo_samples, 2, cfg, seed)
