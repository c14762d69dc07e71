"""Sequence packing: several tokenized samples in one row of up to ``pack_size`` tokens, written as the
``.npy`` files NeMo and NeMo-Aligner use, read back as batches whose attention stays inside each sample.

Formats (numpy object arrays of dicts, ``np.save``):
- NeMo's packed SFT (``prepare_packed_ft_dataset.py``): ``input_ids``, ``loss_mask`` (per token: 1 where
  the token is trained), ``seq_start_id`` (where each sample starts);
- NeMo-Aligner's packed DPO (``prepare_packed_dpo_dataset.py``): ``input_ids``, ``labels`` (the token, or
  -100 where it is not trained), ``reward`` and ``lengths`` (per sequence), ``seq_boundaries`` (0, then the
  end of each sequence: a pair's chosen then its rejected response).

A batch of packs (:func:`collate_packs`) predicts, inside each sample, every token from the ones
before it (each sample loses its last input position, as NeMo's packed collate does), with positions
restarting at each sample and a block-diagonal causal ``attention_mask``: the loss of a sample is the
one it has unpacked.
"""

from __future__ import annotations

import os
import pickle
import random
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from nemo_aligner.utils.errors import ConfigError, DataError

PACKING_ALGORITHMS = ("first_fit_decreasing", "first_fit_shuffle")
LABELS_PAD_ID = -100  # NeMo-Aligner's label of an untrained position


# ----------------------------------------------------------------- bin packing
def first_fit(lengths: Sequence[int], pack_size: int, order: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Sample indices per pack: each sample (in ``order``) goes to the first pack with room for it.
    A max-segment-tree over the packs' free space finds that pack in O(log n)."""
    order = list(range(len(lengths))) if order is None else list(order)
    size = 1
    while size < max(len(order), 1):
        size *= 2
    free = [0] * (2 * size)  # leaves: free space of pack i (0 until opened); internal: max of children
    packs: List[List[int]] = []
    for index in order:
        need = int(lengths[index])
        if need > pack_size:
            raise DataError(f"sample {index} has {need} tokens, more than pack_size={pack_size}")
        if free[1] >= need:
            node = 1
            while node < size:
                node = 2 * node if free[2 * node] >= need else 2 * node + 1
            slot = node - size
        else:
            slot = len(packs)
            packs.append([])
            node = size + slot
            free[node] = pack_size
        packs[slot].append(index)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return packs


def pack_assignments(lengths: Sequence[int], pack_size: int, algorithm: str = "first_fit_shuffle",
                     seed: int = 0) -> List[List[int]]:
    """NeMo's packing algorithms: ``first_fit_decreasing`` (longest first: fuller packs) or
    ``first_fit_shuffle`` (a random order: packs keep the data order random)."""
    if algorithm not in PACKING_ALGORITHMS:
        raise ConfigError(f"packing_algorithm={algorithm!r} is not one of {', '.join(PACKING_ALGORITHMS)}")
    order = list(range(len(lengths)))
    if algorithm == "first_fit_decreasing":
        order.sort(key=lambda i: -int(lengths[i]))
    else:
        random.Random(seed).shuffle(order)
    return first_fit(lengths, pack_size, order)


def pack_sft_samples(samples: Sequence[Dict], pack_size: int, algorithm: str, seed: int) -> List[Dict]:
    """``samples`` (``input_ids``, ``loss_mask`` per token) as NeMo's packed SFT records."""
    packs = pack_assignments([len(s["input_ids"]) for s in samples], pack_size, algorithm, seed)
    out = []
    for members in packs:
        ids, mask, starts = [], [], []
        for i in members:
            starts.append(len(ids))
            ids += list(samples[i]["input_ids"])
            mask += [bool(m) for m in samples[i]["loss_mask"]]
        out.append({"input_ids": ids, "loss_mask": mask, "seq_start_id": starts})
    return out


def pack_dpo_samples(samples: Sequence[Dict], pack_size: int, algorithm: str, seed: int) -> List[Dict]:
    """``samples`` (``chosen``/``rejected`` token lists, ``chosen_prompt``/``rejected_prompt`` prompt
    lengths, ``rewards``) as NeMo-Aligner's packed DPO records: each pair's chosen then rejected."""
    lengths = [len(s["chosen"]) + len(s["rejected"]) for s in samples]
    packs = pack_assignments(lengths, pack_size, algorithm, seed)
    out = []
    for members in packs:
        ids, labels, rewards, seq_lengths, bounds = [], [], [], [], [0]
        for i in members:
            s = samples[i]
            for side in ("chosen", "rejected"):
                tokens, prompt = list(s[side]), int(s[f"{side}_prompt"])
                ids += tokens
                labels += [LABELS_PAD_ID] * prompt + tokens[prompt:]
                seq_lengths.append(len(tokens))
                bounds.append(len(ids))
            rewards += [float(s["rewards"][0]), float(s["rewards"][1])]
        out.append({"input_ids": ids, "labels": labels, "reward": rewards, "lengths": seq_lengths,
                    "seq_boundaries": bounds})
    return out


def packing_report(records: Sequence[Dict], pack_size: int, sequences_per_record: int = 1) -> str:
    """One line: packs, samples per pack, how full they are."""
    tokens = sum(len(r["input_ids"]) for r in records)
    samples = sum(len(r.get("seq_start_id", ())) or (len(r.get("seq_boundaries", [0])) - 1) // sequences_per_record
                  for r in records)
    return (f"{len(records)} packs of up to {pack_size} tokens, {samples / max(len(records), 1):.2f} samples per "
            f"pack, {100.0 * tokens / max(len(records) * pack_size, 1):.1f}% of the pack tokens used")


# ----------------------------------------------------------------- .npy files
_NUMPY_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays of plain data only: a pickled ``.npy`` that names any other callable is
    refused instead of run."""

    def find_class(self, module, name):
        if (module, name) in _NUMPY_GLOBALS or (module.startswith("numpy") and name.endswith("DType")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a packed data file")


def load_packed_records(path: str, key: str) -> list:
    """The records of a packed ``.npy`` (NeMo's object-array format), without running pickled code."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: file does not exist ({key})")
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = header(f)
            if dtype.hasobject:
                array = _ArrayUnpickler(f).load()
            else:
                raise DataError(f"{path}: holds a {dtype} array, not packed records (a numpy array of dicts "
                                f"written by a prepare_packed_*_dataset.py script) ({key})")
    except DataError:
        raise
    except (ValueError, pickle.UnpicklingError, EOFError, TypeError, AttributeError) as err:
        raise DataError(f"{path}: not a packed .npy data file ({err}) ({key})") from None
    records = list(np.asarray(array).reshape(-1))
    if not records:
        raise DataError(f"{path}: holds no packs ({key})")
    return records


def save_packed_records(path: str, records: Sequence[Dict]) -> str:
    """``records`` as NeMo's packed ``.npy`` (an object array of dicts), written to a temp name then renamed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    array = np.empty(len(records), dtype=object)
    for i, record in enumerate(records):
        array[i] = record
    tmp = f"{path}.tmp.npy"
    np.save(tmp, array, allow_pickle=True)
    os.replace(tmp, path)
    return path


def _int_list(value, what: str) -> List[int]:
    try:
        values = [int(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    except (TypeError, ValueError):
        raise DataError(f"{what}: not a list of integers") from None
    return values


def check_packed_record(record, where: str, kind: str, max_length: int, vocab_size: int) -> Dict:
    """One pack as ``{input_ids, loss_mask (per token), boundaries, rewards}``; a malformed pack is a
    ``DataError`` naming it (``where``: file and record number)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a pack must be a dict, got {type(record).__name__}")
    need = ("input_ids", "loss_mask", "seq_start_id") if kind == "sft" else \
        ("input_ids", "labels", "reward", "lengths", "seq_boundaries")
    missing = [k for k in need if k not in record]
    if missing:
        raise DataError(f"{where}: pack has no {', '.join(missing)} (a {kind.upper()} pack holds {', '.join(need)})")
    ids = _int_list(record["input_ids"], f"{where}: input_ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise DataError(f"{where}: token id {bad} is outside the tokenizer's vocabulary (0..{vocab_size - 1})")
    if kind == "sft":
        mask = [bool(m) for m in (record["loss_mask"].tolist() if isinstance(record["loss_mask"], np.ndarray)
                                  else record["loss_mask"])]
        bounds = _int_list(record["seq_start_id"], f"{where}: seq_start_id") + [len(ids)]
        rewards = None
    else:
        labels = _int_list(record["labels"], f"{where}: labels")
        mask = [label != LABELS_PAD_ID for label in labels]
        bounds = _int_list(record["seq_boundaries"], f"{where}: seq_boundaries")
        rewards = [float(r) for r in (record["reward"].tolist() if isinstance(record["reward"], np.ndarray)
                                      else record["reward"])]
        if (len(bounds) - 1) % 2 or len(rewards) != len(bounds) - 1:
            raise DataError(f"{where}: {len(bounds) - 1} sequences with {len(rewards)} rewards; a DPO pack holds "
                            "chosen/rejected pairs, one reward each")
    if len(mask) != len(ids):
        raise DataError(f"{where}: {len(mask)} loss-mask/label entries for {len(ids)} tokens")
    if bounds[0] != 0 or bounds[-1] != len(ids) or any(b - a < 2 for a, b in zip(bounds, bounds[1:])):
        raise DataError(f"{where}: sequence boundaries {bounds[:6]}... do not split the pack's {len(ids)} tokens "
                        "into sequences of 2 or more tokens")
    if len(ids) - (len(bounds) - 1) > max_length:
        raise DataError(f"{where}: pack of {len(ids)} tokens is longer than the model's sequence length "
                        f"{max_length} allows (model.encoder_seq_length / model.data.*.max_seq_length)")
    return {"input_ids": ids, "loss_mask": mask, "boundaries": bounds, "rewards": rewards}


# ----------------------------------------------------------------- batches
def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """``[B, 1, L, L]`` megatron-core attention mask (True: hidden) letting each position see the earlier
    positions of its own segment only; ``segments`` [B, L] numbers the segments of each row."""
    same = segments.unsqueeze(2) == segments.unsqueeze(1)
    causal = torch.ones(segments.shape[1], segments.shape[1], dtype=torch.bool).tril()
    return ~(same & causal).unsqueeze(1)


def collate_packs(packs: Sequence[Dict], pad_id: int, max_length: int, pad_to_multiple_of: int = 16) -> Dict:
    """Packs (:func:`check_packed_record`'s form) as a batch: ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, ``attention_mask`` (block-diagonal causal), ``sequence`` (each position's sequence
    number in its row, -1 on padding), ``num_sequences`` [B], and for DPO ``rewards`` [B, max sequences]."""
    rows = []
    for pack in packs:
        ids, mask, bounds = pack["input_ids"], pack["loss_mask"], pack["boundaries"]
        tokens, labels, loss, positions, sequence = [], [], [], [], []
        for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
            tokens += ids[start : end - 1]
            labels += ids[start + 1 : end]
            loss += mask[start + 1 : end]
            positions += range(end - start - 1)
            sequence += [n] * (end - start - 1)
        rows.append((tokens, labels, loss, positions, sequence))
    longest = max(len(r[0]) for r in rows)
    multiple = max(int(pad_to_multiple_of or 1), 1)
    length = min(-(-longest // multiple) * multiple, max_length)
    if longest > length:
        raise DataError(f"a pack of {longest} positions does not fit the sequence length {max_length}")
    batch = len(rows)
    out = {
        "tokens": torch.full((batch, length), pad_id, dtype=torch.long),
        "labels": torch.full((batch, length), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros(batch, length),
        "position_ids": torch.zeros(batch, length, dtype=torch.long),
        "sequence": torch.full((batch, length), -1, dtype=torch.long),
        "num_sequences": torch.tensor([len(p["boundaries"]) - 1 for p in packs], dtype=torch.long),
        "pack_weight": torch.tensor([0.0 if p.get("padding") else 1.0 for p in packs]),
    }
    for b, (tokens, labels, loss, positions, sequence) in enumerate(rows):
        n = len(tokens)
        out["tokens"][b, :n] = torch.tensor(tokens)
        out["labels"][b, :n] = torch.tensor(labels)
        out["loss_mask"][b, :n] = torch.tensor(loss, dtype=torch.float32)
        out["position_ids"][b, :n] = torch.tensor(positions)
        out["sequence"][b, :n] = torch.tensor(sequence)
    # padding attends to itself only (one segment per row past the last sample): no empty softmax rows
    segments = torch.where(out["sequence"] >= 0, out["sequence"], out["num_sequences"].unsqueeze(1))
    out["attention_mask"] = block_causal_mask(segments)
    if packs[0].get("rewards") is not None:
        width = int(out["num_sequences"].max())
        out["rewards"] = torch.full((batch, width), -1000.0)
        for b, pack in enumerate(packs):
            out["rewards"][b, : len(pack["rewards"])] = torch.tensor(pack["rewards"])
    return out


def sequence_sums(values: torch.Tensor, sequence: torch.Tensor, num_sequences: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums of ``values`` [B, L] over each row's sequences (``sequence`` from
    :func:`collate_packs`), flattened row by row: ``[sum(num_sequences)]``."""
    width = int(num_sequences.max())
    valid = sequence >= 0
    index = (torch.arange(values.shape[0], device=values.device).unsqueeze(1) * width + sequence)[valid]
    sums = torch.zeros(values.shape[0] * width, dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, index, values[valid])
    keep = (torch.arange(width, device=values.device).unsqueeze(0) < num_sequences.to(values.device).unsqueeze(1))
    return sums.view(values.shape[0], width)[keep]


class PackedDataset(torch.utils.data.Dataset):
    """The packs of one or more ``.npy`` files, each checked when read (``kind``: ``sft`` or ``dpo``)."""

    def __init__(self, paths, kind: str, max_length: int, vocab_size: int, key: str):
        paths = [paths] if isinstance(paths, str) else list(paths)
        self.kind, self.packs, self.file_path = kind, [], ",".join(map(str, paths))
        for path in paths:
            for i, record in enumerate(load_packed_records(str(path), key)):
                self.packs.append(check_packed_record(record, f"{path}: pack {i}", kind, max_length, vocab_size))

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:  # padding of a partial validation batch: a pack that trains nothing
            pairs = 2 if self.kind == "dpo" else 1
            return {"input_ids": [0] * 2 * pairs, "loss_mask": [False] * 2 * pairs,
                    "boundaries": list(range(0, 2 * pairs + 1, 2)), "rewards": [0.0] * pairs if pairs == 2 else None,
                    "padding": True}
        return self.packs[idx]
