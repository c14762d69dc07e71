"""Read megatron-core's zarr-format distributed checkpoints (NeMo's ``dist_ckpt_format: zarr``).

megatron-core dropped the zarr backend; its checkpoints still exist. The layout is zarr v2: one
directory per tensor, named by its sharded key (``model.decoder.layers.self_attention.linear_qkv.
weight``, layers stacked on the first axis), holding ``.zarray`` (shape, chunks, dtype,
compressor) and one file per chunk (``0.0.0``). Chunks are decoded with ``numcodecs`` (zarr's own
codec library; megatron-core wrote them with zarr's default Blosc compressor). ``bfloat16`` is
stored as 2-byte words. Non-tensor state (``_extra_state``) is not read.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from typing import Dict

import numpy as np
import torch

from nemo_aligner.utils.errors import CheckpointError
from nemo_aligner.utils.legacy_checkpoint import TE_NORM_ALIASES

_TE_TO_LOCAL = {te: local for local, te in TE_NORM_ALIASES.items()}
# A mixture-of-experts layer's experts, stacked over the expert axis after the layer axis.
_STACKED_EXPERTS = "mlp.experts.experts."


def is_zarr_checkpoint(directory: str) -> bool:
    try:
        with open(os.path.join(directory, "metadata.json"), encoding="utf-8") as f:
            return json.load(f).get("sharded_backend") == "zarr"
    except (OSError, ValueError, AttributeError):
        return False


def _storage_dtype(name: str):
    """``(numpy dtype to read, torch dtype to view as or None)``."""
    if name in ("bfloat16", "<V2", "|V2", "V2"):
        return np.dtype("<u2"), torch.bfloat16
    try:
        return np.dtype(name), None
    except TypeError as err:
        raise CheckpointError(f"zarr dtype {name!r} is not supported") from err


def read_zarr_array(directory: str) -> torch.Tensor:
    """One zarr v2 array as a tensor."""
    try:
        with open(os.path.join(directory, ".zarray"), encoding="utf-8") as f:
            meta = json.load(f)
        shape, chunks = [int(s) for s in meta["shape"]], [int(c) for c in meta["chunks"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{directory}: not a readable zarr array ({err})") from err
    if meta.get("zarr_format", 2) != 2 or len(shape) != len(chunks):
        raise CheckpointError(f"{directory}: zarr format {meta.get('zarr_format')} is not supported (v2 only)")
    dtype, view_as = _storage_dtype(meta["dtype"])
    order = meta.get("order", "C")
    codec = None
    if meta.get("compressor"):
        try:
            import numcodecs
        except ImportError as err:
            raise CheckpointError(f"{directory}: a compressed zarr checkpoint needs numcodecs "
                                  "(pip install numcodecs, or nemo-aligner[zarr])") from err
        codec = numcodecs.get_codec(meta["compressor"])
    filters = []
    if meta.get("filters"):
        import numcodecs

        filters = [numcodecs.get_codec(f) for f in meta["filters"]]
    sep = meta.get("dimension_separator", ".")
    out = np.zeros(shape, dtype=dtype)
    grid = [range(math.ceil(s / c)) if c else range(1) for s, c in zip(shape, chunks)]
    for index in itertools.product(*grid):
        name = sep.join(str(i) for i in index) if index else "0"
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{directory}: chunk {name} is missing; the checkpoint is incomplete")
        with open(path, "rb") as f:
            raw = f.read()
        if codec is not None:
            raw = codec.decode(raw)
        for flt in reversed(filters):
            raw = flt.decode(raw)
        chunk = np.frombuffer(bytes(raw), dtype=dtype)
        if chunk.size != math.prod(chunks):
            raise CheckpointError(f"{directory}: chunk {name} has {chunk.size} values, not {math.prod(chunks)}")
        chunk = chunk.reshape(chunks, order=order)
        where = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunks, shape))
        out[where] = chunk[tuple(slice(0, w.stop - w.start) for w in where)]
    tensor = torch.from_numpy(out)
    return tensor.view(view_as) if view_as is not None else tensor


def _layer_tensors(layer: int, rest: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One layer's slice of a stacked tensor under its per-layer name(s): a MoE layer's experts are
    stacked once more, [expert, ...] (megatron-core's SequentialMLP), and become one tensor each."""
    if rest.startswith(_STACKED_EXPERTS):
        name = rest[len(_STACKED_EXPERTS):]
        return {f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{name}": tensor[e].clone()
                for e in range(tensor.shape[0])}
    return {f"decoder.layers.{layer}.{rest}": tensor.clone()}


def read_zarr_weights(directory: str, num_layers: int) -> Dict[str, torch.Tensor]:
    """The model's tensors as ``{megatron-core local-spec name: tensor}`` with per-layer names."""
    full: Dict[str, torch.Tensor] = {}
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if not os.path.isfile(os.path.join(path, ".zarray")) or not entry.startswith("model."):
            continue  # optimizer state, non-tensor objects
        key = entry[len("model."):]
        if key.endswith(("_w", "_v")) and key[:-2].endswith("linear_fc1.weight"):
            continue  # singleton gated halves, joined below
        tensor = read_zarr_array(path)
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers."):]
            rest = _TE_TO_LOCAL.get(rest, rest)
            if tensor.shape[0] != num_layers:
                raise CheckpointError(f"{path}: {tensor.shape[0]} stacked layers, the config has {num_layers}")
            for i in range(num_layers):
                full.update(_layer_tensors(i, rest, tensor[i]))
        else:
            full[key] = tensor
    for entry in sorted(os.listdir(directory)):  # megatron-core's singleton-shard gated fc1: key_w, key_v
        if entry.startswith("model.decoder.layers.") and entry.endswith("linear_fc1.weight_w"):
            w = read_zarr_array(os.path.join(directory, entry))
            v = read_zarr_array(os.path.join(directory, entry[:-2] + "_v"))
            rest = entry[len("model.decoder.layers."):-2]
            for i in range(num_layers):
                full.update(_layer_tensors(i, rest, torch.cat([w[i], v[i]], dim=-2)))
    if not full:
        raise CheckpointError(f"{directory}: a zarr checkpoint with no model tensors")
    return full
