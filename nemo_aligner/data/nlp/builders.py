"""Datasets and data loaders from ``model.data.*`` config."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from nemo_aligner.data.nlp.jsonl import read_jsonl_files
from nemo_aligner.data.nlp.samplers import GlobalBatchSampler
from nemo_aligner.data.nlp.sft_dataset import GPTSFTChatDataset, GPTSFTDataset, collate_sft, report_lengths
from nemo_aligner.utils.errors import ConfigError


def _records(paths, key: str):
    records = read_jsonl_files(paths, f"{key}.file_path")
    names = [paths] if isinstance(paths, str) else list(paths)
    return records, str(names[0]) if len(names) == 1 else ",".join(map(str, names))


class SampledDataset(torch.utils.data.Dataset):
    """``num_samples`` records of ``dataset`` as NeMo's ``model.data.sample=True`` index mapping draws them:
    whole passes over the records, each pass in its own seeded order, cut at ``num_samples``. Every record
    appears ``num_samples // len(dataset)`` or one more times; fewer samples than records take a random part."""

    def __init__(self, dataset, num_samples: int, seed: int, key: str = "model.data.train_ds"):
        n = len(dataset)
        if n == 0:
            raise ConfigError(f"{key}: no records to sample {num_samples} from")
        generator = torch.Generator().manual_seed(seed)
        passes = -(-int(num_samples) // n)
        self.indices = torch.cat([torch.randperm(n, generator=generator) for _ in range(passes)])[:int(num_samples)]
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.dataset[int(self.indices[index])]

    def __getattr__(self, name):  # the wrapped dataset's own attributes (its name, tokenizer, ...)
        if name in ("dataset", "indices"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


def build_sft_dataset(ds_cfg, tokenizer, max_seq_length: int, chat: bool, answer_only_loss: bool,
                      chat_prompt_tokens=None, key: str = "model.data.train_ds"):
    """A prompt/answer or chat SFT dataset from one ``model.data.*_ds`` section (with ``packed_sequence``:
    the packs of a ``.npy`` written by ``prepare_packed_ft_dataset.py``)."""
    seq = min(int(ds_cfg.get("max_seq_length") or max_seq_length), int(max_seq_length))
    if bool(ds_cfg.get("packed_sequence", False)):
        from nemo_aligner.data.nlp.packing import PackedDataset

        return PackedDataset(ds_cfg.get("file_path") or ds_cfg.get("file_names"), "sft", seq, tokenizer.vocab_size,
                             f"{key}.file_path")
    records, name = _records(ds_cfg.get("file_path") or ds_cfg.get("file_names"), key)
    chat_key = key.rsplit(".", 1)[0] + ".chat"  # model.data.train_ds -> model.data.chat
    if chat:
        dataset = GPTSFTChatDataset(name, tokenizer, seq, chat_prompt_tokens=chat_prompt_tokens,
                                    answer_only_loss=answer_only_loss, records=records, chat_key=chat_key)
        report_lengths(dataset, key)
        return dataset
    dataset = GPTSFTDataset(
        name, tokenizer, seq,
        prompt_template=ds_cfg.get("prompt_template", "{input} {output}"),
        label_key=ds_cfg.get("label_key", "output"),
        add_bos=bool(ds_cfg.get("add_bos", False)),
        add_eos=bool(ds_cfg.get("add_eos", True)),
        add_sep=bool(ds_cfg.get("add_sep", False)),
        truncation_method=ds_cfg.get("truncation_method", "right"),
        answer_only_loss=answer_only_loss,
        records=records,
        chat_key=chat_key,
    )
    report_lengths(dataset, key)
    return dataset


def build_dataloader(dataset, ds_cfg, collate_fn: Callable, dp_rank: int, dp_size: int, seed: int,
                     consumed_samples: int = 0, num_workers: int = 0, train: bool = True,
                     key: str = "model.data.train_ds", group_size: int = 1) -> torch.utils.data.DataLoader:
    """A DataLoader yielding this DP rank's part of each global batch (``global_batch_size``)."""
    gbs = int(ds_cfg.global_batch_size)
    mbs = int(ds_cfg.micro_batch_size)
    if (gbs // dp_size) % mbs != 0:
        raise ConfigError(
            f"{key}.global_batch_size={gbs} / data-parallel size {dp_size} is not a multiple of "
            f"{key}.micro_batch_size={mbs}"
        )
    sampler = GlobalBatchSampler(
        total_samples=len(dataset), global_batch_size=gbs, dp_rank=dp_rank, dp_size=dp_size,
        shuffle=bool(ds_cfg.get("shuffle", train)), seed=seed,
        drop_last=bool(ds_cfg.get("drop_last", train)),
        consumed_samples=consumed_samples, key=key, group_size=group_size,
    )
    # A private generator: creating an iterator would otherwise draw from the global torch RNG
    # (worker seeds), so dropout after a resume would see a different random stream.
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
        persistent_workers=False, pin_memory=False, generator=generator,
    )


def sft_collate_fn(tokenizer, max_seq_length: int, pad_to_multiple_of: int = 8):
    """Batches of SFT samples, or of packs (a dataset with ``packed_sequence``)."""
    from nemo_aligner.data.nlp.packing import collate_packs

    def collate(samples):
        if "boundaries" in samples[0]:
            return collate_packs(samples, tokenizer.eos_id, max_seq_length, max(pad_to_multiple_of, 16))
        return collate_sft(samples, tokenizer.eos_id, max_seq_length, pad_to_multiple_of)
    return collate


def limit_batches(limit, total: int) -> int:
    """Lightning's ``limit_*_batches``: a float fraction of ``total`` or an int count (``-1``/None: all)."""
    if limit is None:
        return total
    if isinstance(limit, float) and limit <= 1.0:
        if limit <= 0.0:  # 0.0 turns the loop off, as 0 does (and as in Lightning)
            return 0
        return max(int(total * limit), 1 if total else 0)
    limit = int(limit)
    return total if limit < 0 else min(limit, total)


def sampler_of(loader) -> Optional[GlobalBatchSampler]:
    return loader.batch_sampler if isinstance(loader.batch_sampler, GlobalBatchSampler) else None
