"""Global-batch samplers whose order depends only on (seed, epoch, consumed samples).

That makes resuming exact: a run restarted from a checkpoint with the same
``consumed_samples`` sees the same batches, in the same order, as one that never
stopped.
"""

from __future__ import annotations

from typing import Iterator, List

import torch

from nemo_aligner.utils.errors import ConfigError


class GlobalBatchSampler:
    """Yields this data-parallel rank's share of each global batch (a list of dataset indices).

    One pass over the iterator is one epoch (from the current position to its end).
    With ``drop_last`` the final partial global batch is skipped; without it, it is
    padded with index ``-1`` (datasets return a sample that carries no loss). ``group_size``
    consecutive records are shuffled as one (a preference pair stays together).
    """

    def __init__(self, total_samples: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 shuffle: bool = True, seed: int = 1234, drop_last: bool = True, consumed_samples: int = 0,
                 key: str = "model.data.train_ds", group_size: int = 1):
        if global_batch_size % dp_size != 0:
            raise ConfigError(
                f"{key}.global_batch_size={global_batch_size} is not divisible by the data-parallel size {dp_size}"
            )
        if total_samples <= 0:
            raise ConfigError(f"{key}: the dataset is empty")
        if drop_last and total_samples < global_batch_size:
            raise ConfigError(
                f"{key}.global_batch_size={global_batch_size} is larger than the dataset ({total_samples} samples); "
                f"lower it or add data"
            )
        self.total_samples = total_samples
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.consumed_samples = consumed_samples
        # Consecutive records that stay together when shuffled (a preference pair: 2).
        self.group_size = max(int(group_size), 1)
        if total_samples % self.group_size:
            raise ConfigError(f"{key}: {total_samples} records do not split into groups of {self.group_size} "
                              "consecutive records")
        # limit_train_batches: an epoch may stop early; set by the trainer.
        self.max_batches_per_epoch = None

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            full = self.total_samples // self.global_batch_size
        else:
            full = -(-self.total_samples // self.global_batch_size)
        return full if self.max_batches_per_epoch is None else min(full, self.max_batches_per_epoch)

    @property
    def samples_per_epoch(self) -> int:
        return self.batches_per_epoch * self.global_batch_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return self.batches_per_epoch - (self.consumed_samples % self.samples_per_epoch) // self.global_batch_size

    def epoch_order(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(range(self.total_samples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        if self.group_size == 1:
            return torch.randperm(self.total_samples, generator=generator).tolist()
        groups = torch.randperm(self.total_samples // self.group_size, generator=generator).tolist()
        return [g * self.group_size + i for g in groups for i in range(self.group_size)]

    def __iter__(self) -> Iterator[List[int]]:
        epoch = self.epoch
        order = self.epoch_order(epoch)
        order += [-1] * max(self.samples_per_epoch - len(order), 0)
        start = (self.consumed_samples % self.samples_per_epoch) // self.global_batch_size
        for b in range(start, self.batches_per_epoch):
            batch = order[b * self.global_batch_size : (b + 1) * self.global_batch_size]
            lo = self.dp_rank * self.local_batch_size
            # consumed_samples is advanced by the trainer after a successful step, not here,
            # so a prefetching DataLoader cannot make it run ahead.
            yield batch[lo : lo + self.local_batch_size]
