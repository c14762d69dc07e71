"""NeMo's pre-distributed-checkpoint weights: ``model_weights.ckpt`` in a ``.nemo``.

Layouts read (as NeMo's ``NLPSaveRestoreConnector`` writes them)::

    model_weights.ckpt                                  one process
    mp_rank_0X/model_weights.ckpt                       tensor parallel (X: TP rank)
    tp_rank_0X_pp_rank_00Y/model_weights.ckpt           tensor and pipeline parallel

Key names are either megatron-core's (``model.decoder.layers.N.self_attention.linear_qkv.weight``,
``mcore_gpt: True``) or NeMo's earlier Megatron ones (``model.language_model.encoder.layers.N.
self_attention.query_key_value.weight``), with ``model.module.`` under ``megatron_amp_O2``. They
are mapped onto megatron-core's local-spec names, TP shards are concatenated (column-parallel
on dim 0, row-parallel on dim 1, gated fc1 halves kept apart) and pipeline stages renumbered,
giving the whole model as one state dict of per-layer tensors.
"""

from __future__ import annotations

import io
import os
import re
from typing import Dict, List, Tuple

import torch

from nemo_aligner.utils.errors import CheckpointError

LEGACY_WEIGHTS = "model_weights.ckpt"
_RANK_DIR = re.compile(r"^(?:mp_rank_(\d+)|tp_rank_(\d+)_pp_rank_(\d+))$")

# Transformer Engine fuses the layer norms into the next linear; the local spec keeps them apart.
TE_NORM_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_TE_TO_LOCAL = {te: local for local, te in TE_NORM_ALIASES.items()}

# NeMo's Megatron (non-mcore) GPT names -> megatron-core's (per layer suffixes).
_LEGACY_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "post_attention_layernorm.bias": "pre_mlp_layernorm.bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1_gate.weight",  # the whole fc1 unless a _2 half exists
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1_gate.bias",
    "mlp.dense_h_to_4h_2.weight": "mlp.linear_fc1_up.weight",  # the gated unit's second half, merged below
    "mlp.dense_h_to_4h_2.bias": "mlp.linear_fc1_up.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}
_LEGACY_TOP = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "language_model.encoder.final_layernorm.weight": "decoder.final_layernorm.weight",
    "language_model.encoder.final_layernorm.bias": "decoder.final_layernorm.bias",
    "language_model.output_layer.weight": "output_layer.weight",
    "word_embeddings.weight": "tied.word_embeddings.weight",  # the last stage's copy of tied embeddings
}
_LAYER = re.compile(r"^(?:decoder|language_model\.encoder)\.layers\.(\d+)\.(.+)$")

# TP split dimension of each megatron-core tensor (None: replicated).
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
           "mlp.linear_fc1.bias", "mlp.linear_fc1_gate.weight", "mlp.linear_fc1_gate.bias", "mlp.linear_fc1_up.weight",
           "mlp.linear_fc1_up.bias")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def legacy_weight_files(nemo_dir: str) -> List[Tuple[int, int, str]]:
    """``(tp_rank, pp_rank, path)`` of every ``model_weights.ckpt`` in an extracted .nemo ([] if none)."""
    single = os.path.join(nemo_dir, LEGACY_WEIGHTS)
    if os.path.isfile(single):
        return [(0, 0, single)]
    found = []
    for entry in sorted(os.listdir(nemo_dir)):
        match = _RANK_DIR.match(entry)
        path = os.path.join(nemo_dir, entry, LEGACY_WEIGHTS)
        if match and os.path.isfile(path):
            tp = int(match.group(1) if match.group(1) is not None else match.group(2))
            pp = int(match.group(3) or 0)
            found.append((tp, pp, path))
    return found


def _torch_load(path: str) -> dict:
    """Tensors only (no arbitrary objects are unpickled); Transformer Engine's extra state is a BytesIO."""
    try:
        with torch.serialization.safe_globals([io.BytesIO]):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad checkpoint
        raise CheckpointError(f"{path}: cannot be read as a weights-only torch checkpoint ({err})") from err
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds no state dict")
    return state


def _canonical(key: str) -> str | None:
    """megatron-core local-spec name of a stored key (None: not a weight: extra state, buffers)."""
    if key.startswith("model.module."):  # megatron_amp_O2's Float16Module wrapper
        key = "model." + key[len("model.module."):]
    if key.startswith("model."):
        key = key[len("model."):]
    if key.endswith("_extra_state") or key.endswith("inv_freq") or "rotary_pos_emb" in key:
        return None
    if key in _LEGACY_TOP:
        return _LEGACY_TOP[key]
    layer = _LAYER.match(key)
    if layer:
        index, rest = layer.groups()
        if key.startswith("language_model."):
            if rest not in _LEGACY_LAYER:
                raise CheckpointError(f"tensor {key!r} of the legacy checkpoint has no megatron-core counterpart")
            rest = _LEGACY_LAYER[rest]
        rest = _TE_TO_LOCAL.get(rest, rest)
        return f"decoder.layers.{index}.{rest}"
    return key


def _tp_dim(name: str):
    suffix = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if suffix in _COLUMN or name in _VOCAB:
        return 0
    if suffix in _ROW:
        return 1
    return None


def _merge_tp(name: str, shards: List[torch.Tensor], fused_gated: bool) -> torch.Tensor:
    dim = _tp_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if fused_gated:
        # megatron-core keeps each rank's fc1 as [gate_r; up_r]: concatenate the gates, then the ups
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=dim)


def read_legacy_weights(nemo_dir: str, gated: bool) -> Dict[str, torch.Tensor]:
    """The whole model as ``{megatron-core local-spec name: tensor}`` with global layer numbers.

    ``gated``: the MLP is a gated linear unit (swiglu/geglu/reglu).
    """
    files = legacy_weight_files(nemo_dir)
    if not files:
        raise CheckpointError(f"{nemo_dir}: no {LEGACY_WEIGHTS}")
    tps = sorted({tp for tp, _, _ in files})
    pps = sorted({pp for _, pp, _ in files})
    if tps != list(range(len(tps))) or pps != list(range(len(pps))) or len(files) != len(tps) * len(pps):
        raise CheckpointError(f"{nemo_dir}: the legacy weights are incomplete (found TP ranks {tps}, PP ranks {pps} "
                              f"in {len(files)} files)")
    by_rank = {(tp, pp): path for tp, pp, path in files}
    merged: Dict[str, torch.Tensor] = {}
    layer_offset = 0
    for pp in pps:
        stage: Dict[str, List[torch.Tensor]] = {}
        for tp in tps:
            for key, value in _torch_load(by_rank[(tp, pp)]).items():
                if not isinstance(value, torch.Tensor):
                    continue
                name = _canonical(key)
                if name is not None:
                    stage.setdefault(name, []).append(value)
        layers = set()
        for name, shards in stage.items():
            if len(shards) != len(tps):
                raise CheckpointError(f"{nemo_dir}: tensor {name!r} is in {len(shards)} of the {len(tps)} "
                                      f"tensor-parallel files of pipeline stage {pp}")
            # one fc1 holding both halves of a gated unit (megatron-core, and NeMo's fast-*glu): each rank
            # has [gate_r; up_r]; NeMo's plain *glu keeps the up half in a second linear (dense_h_to_4h_2)
            fc1 = name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")) or (
                ".mlp.linear_fc1_gate." in name and name.replace("linear_fc1_gate", "linear_fc1_up") not in stage)
            tensor = _merge_tp(name, shards, fused_gated=gated and fc1)
            layer = _LAYER.match(name)
            if layer:  # stage-local layer numbers -> global
                layers.add(int(layer.group(1)))
                name = f"decoder.layers.{int(layer.group(1)) + layer_offset}.{layer.group(2)}"
            if name == "tied.word_embeddings.weight":
                continue  # the last stage's copy of the tied embeddings: the first stage holds them
            merged[name] = tensor
        layer_offset += len(layers)
    # NeMo's Megatron GPT keeps a gated unit's halves in two linears; megatron-core's fc1 is [gate; up]
    for name in [n for n in merged if ".mlp.linear_fc1_gate." in n]:
        gate = merged.pop(name)
        up = merged.pop(name.replace("linear_fc1_gate", "linear_fc1_up"), None)
        merged[name.replace("linear_fc1_gate", "linear_fc1")] = gate if up is None else torch.cat([gate, up], dim=0)
    return merged


def vocab_rows(state: Dict[str, torch.Tensor]) -> int | None:
    emb = state.get("embedding.word_embeddings.weight")
    if emb is None:
        emb = state.get("output_layer.weight")
    return None if emb is None else int(emb.shape[0])
