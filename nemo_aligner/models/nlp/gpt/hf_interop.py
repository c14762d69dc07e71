"""Hugging Face <-> megatron-core conversion for Llama (Mistral, Mixtral), Qwen2, Gemma and GPT-2 checkpoints.

``import_hf_model(hf_dir, nemo_path)`` reads a local ``config.json`` + safetensors (or
``pytorch_model.bin``) directory and writes a ``.nemo`` whose model gives the same logits;
``export_to_hf(nemo_path, out_dir)`` writes the reverse, loadable by ``transformers``. Fused
layouts: megatron-core's ``linear_qkv`` holds, per query group, that group's query heads then
one key and one value head; ``linear_fc1`` of a gated MLP is ``[gate; up]``.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import shutil
from typing import Dict, Optional, Tuple

import torch

from nemo_aligner.models.nlp.gpt.gpt_builder import attention_window, num_moe_experts, rope_scaling_factor
from nemo_aligner.utils.errors import CheckpointError, ConfigError
from nemo_aligner.utils.tokenizers.hf_export import TOKENIZER_FILE_NAMES

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "gpt2", "gemma")
# Gemma's RMSNorm scales by (1 + weight): NeMo stores weight + 1 (its converter's), a plain RMSNorm.
_ONE_CENTRED_NORMS = ("gemma",)
# Imported as Llama (the same layers and weight names); exported back as Llama.
LLAMA_LIKE = ("mistral",)
# Llama's attention with routed experts (block_sparse_moe.*): imported and exported as Mixtral.
MIXTRAL = "mixtral"
# Architectures whose Hugging Face tokenizers add BOS in encode(): an exported tokenizer does too.
_ADDS_BOS = ("llama", "gemma", MIXTRAL) + LLAMA_LIKE


# ----------------------------------------------------------------------------- configs
_REQUIRED = object()


def _int_value(hf: dict, key: str, where: str, default=_REQUIRED, name: Optional[str] = None) -> int:
    """``config.json``'s positive integer ``key`` (null or absent: ``default``); ``name``: the key's
    name in messages."""
    value, name = hf.get(key), name or key
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{where}: no {name} (a positive integer)")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {name}={value!r} must be a positive integer")
    return value


def _float_value(hf: dict, key: str, where: str, default: Optional[float], positive: bool = False,
                 name: Optional[str] = None) -> Optional[float]:
    """``config.json``'s finite, non-negative (or positive) number ``key`` (null or absent: ``default``)."""
    value, name = hf.get(key), name or key
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        raise ConfigError(f"{where}: {name}={value!r} must be a {'positive' if positive else 'non-negative'} number")
    return float(value)


def _bool_value(hf: dict, key: str, where: str, default: bool) -> bool:
    """``config.json``'s boolean ``key`` (null or absent: ``default``); "false" or 0 would otherwise read as true."""
    value = _of_type(hf, key, where, bool, "true or false")
    return default if value is None else value


def _of_type(hf: dict, key: str, where: str, kind: type, what: str):
    """``config.json``'s ``key`` when it is a ``kind`` (null or absent: None)."""
    value = hf.get(key)
    if value is not None and not isinstance(value, kind):
        raise ConfigError(f"{where}: {key}={value!r} must be {what}")
    return value


def nemo_config_from_hf(hf: dict, where: str) -> Tuple[str, dict]:
    """``(architecture, model config keys)`` for an HF ``config.json``; every value read is checked."""
    arch = str(hf.get("model_type", "")).lower()
    if arch not in ARCHITECTURES + LLAMA_LIKE + (MIXTRAL,):
        raise ConfigError(f"{where}: model_type={hf.get('model_type')!r} is not supported; "
                          f"supported: {', '.join(ARCHITECTURES + LLAMA_LIKE + (MIXTRAL,))}")
    window = hf.get("sliding_window") if arch in ("mistral", MIXTRAL) else None
    experts = {}
    if arch == MIXTRAL:
        # Mixtral's router: softmax over the top-k logits (HF: softmax over all, top-k, renormalised: the same)
        count = _int_value(hf, "num_local_experts", where)
        experts = {"num_moe_experts": count, "moe_router_topk": _int_value(hf, "num_experts_per_tok", where, 2),
                   "moe_router_load_balancing_type": "aux_loss",
                   "moe_aux_loss_coeff": _float_value(hf, "router_aux_loss_coef", where, 0.001),
                   "moe_input_jitter_eps": _float_value(hf, "router_jitter_noise", where, 0.0) or None}
        if experts["moe_router_topk"] > count:
            raise ConfigError(f"{where}: num_experts_per_tok={experts['moe_router_topk']} is more than "
                              f"num_local_experts={count}")
    architectures = _of_type(hf, "architectures", where, list, "a list of class names") or []
    if not all(isinstance(a, str) for a in architectures):
        raise ConfigError(f"{where}: architectures={architectures!r} must be a list of class names")
    heads_of = [a for a in architectures if not (a.endswith("ForCausalLM") or a == "GPT2LMHeadModel")]
    if heads_of:  # a classifier's score head (or another head) would be dropped without a word
        raise ConfigError(f"{where}: architectures={heads_of} is not a causal language model; only *ForCausalLM "
                          "(GPT2LMHeadModel) checkpoints are imported")
    layer_types = _of_type(hf, "layer_types", where, list, "a list of attention types") or []
    if _bool_value(hf, "use_sliding_window", where, False) or "sliding_attention" in layer_types:
        raise ConfigError(f"{where}: sliding-window attention (use_sliding_window/layer_types) is not supported")
    if arch == "gpt2" and (_bool_value(hf, "scale_attn_by_inverse_layer_idx", where, False)
                           or not _bool_value(hf, "scale_attn_weights", where, True)):
        raise ConfigError(f"{where}: scale_attn_by_inverse_layer_idx=True or scale_attn_weights=False is not "
                          "supported (attention would be scaled differently)")
    vocab = _int_value(hf, "vocab_size", where)
    common = {"make_vocab_size_divisible_by": 128, "padded_vocab_size": -(-vocab // 128) * 128,
              "hidden_dropout": 0.0, "attention_dropout": 0.0, "ffn_dropout": 0.0,
              "init_method_std": _float_value(hf, "initializer_range", where, 0.02), "hf_vocab_size": vocab}
    if arch == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"{where}: activation_function={act!r} is not supported")
        hidden, heads = _int_value(hf, "n_embd", where), _int_value(hf, "n_head", where)
        if hidden % heads:
            raise ConfigError(f"{where}: n_embd={hidden} is not a multiple of n_head={heads}")
        positions = _int_value(hf, "n_positions", where)
        return arch, dict(common, num_layers=_int_value(hf, "n_layer", where), hidden_size=hidden,
                          ffn_hidden_size=_int_value(hf, "n_inner", where, 4 * hidden), num_attention_heads=heads,
                          num_query_groups=None, max_position_embeddings=positions,
                          encoder_seq_length=positions, position_embedding_type="learned_absolute",
                          normalization="layernorm",
                          layernorm_epsilon=_float_value(hf, "layer_norm_epsilon", where, 1e-5, positive=True),
                          # NeMo's name for GPT-2's tanh GELU: gelu with openai_gelu (its approx-gelu is x*sigmoid(1.702x))
                          activation="gelu", openai_gelu=act != "gelu", bias=True, qkv_bias=True,
                          share_embeddings_and_output_weights=_bool_value(hf, "tie_word_embeddings", where, True))
    gemma = arch == "gemma"
    if gemma:  # Gemma's official configs say "gelu" and mean the tanh approximation (as transformers reads them)
        for key, allowed in (("hidden_act", ("gelu", "gelu_pytorch_tanh")), ("hidden_activation", (None, "gelu_pytorch_tanh"))):
            if hf.get(key, allowed[-1]) not in allowed:
                raise ConfigError(f"{where}: {key}={hf.get(key)!r} is not supported (gelu_pytorch_tanh only)")
    elif hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf.get('hidden_act')!r} is not supported (silu only)")
    # transformers < 5: rope_theta / rope_scaling; >= 5: rope_parameters {rope_theta, rope_type}
    rope = dict(_of_type(hf, "rope_parameters", where, dict, "an object") or {})
    scaling = _of_type(hf, "rope_scaling", where, dict, "an object") or \
        (rope if rope.get("rope_type", "default") != "default" else None)
    scaled = {}
    if scaling:
        scaled = {"scale_positional_embedding": True, "scale_factor": _llama3_rope_factor(scaling, where)}
    rope_theta = _float_value(rope, "rope_theta", where, None, positive=True, name="rope_parameters.rope_theta") or \
        _float_value(hf, "rope_theta", where, 10000.0, positive=True)
    hidden, heads = _int_value(hf, "hidden_size", where), _int_value(hf, "num_attention_heads", where)
    groups = _int_value(hf, "num_key_value_heads", where, heads)
    if heads % groups:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    if hf.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    head_dim = _int_value(hf, "head_dim", where, hidden // heads)
    qkv_bias = True if arch == "qwen2" else _bool_value(hf, "attention_bias", where, False)
    if arch in ("llama", "gemma", MIXTRAL) + LLAMA_LIKE and (_bool_value(hf, "mlp_bias", where, False) or qkv_bias):
        raise ConfigError(f"{where}: attention_bias/mlp_bias=True is not supported")
    positions = _int_value(hf, "max_position_embeddings", where, 2048)
    seq = min(positions, 4096)
    windowed = {}
    if window is not None:
        # Hugging Face's sliding_window counts the query's own position: window_size [window - 1, 0]
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"{where}: sliding_window={window!r} must be a positive integer or null")
        windowed = {"window_size": [window - 1, 0]}
    arch = "llama" if arch in LLAMA_LIKE else arch
    if arch == MIXTRAL and hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf.get('hidden_act')!r} is not supported (silu only)")
    # Gemma as NeMo's converter writes it: GeGLU with the tanh GELU, embeddings times sqrt(hidden)
    gemma_keys = dict(activation="geglu", openai_gelu=True, apply_embedding_scaling=True) if gemma else {}
    return arch, dict(common, num_layers=_int_value(hf, "num_hidden_layers", where), hidden_size=hidden,
                      ffn_hidden_size=_int_value(hf, "intermediate_size", where), num_attention_heads=heads,
                      num_query_groups=groups,
                      kv_channels=head_dim if head_dim * heads != hidden else None,
                      max_position_embeddings=positions, encoder_seq_length=seq,
                      position_embedding_type="rope", rotary_base=int(rope_theta),
                      normalization="rmsnorm", layernorm_epsilon=_float_value(hf, "rms_norm_eps", where, 1e-6, positive=True),
                      bias=False, qkv_bias=qkv_bias,
                      share_embeddings_and_output_weights=_bool_value(hf, "tie_word_embeddings", where, gemma), **scaled,
                      **windowed, **experts, **(gemma_keys or {"activation": "swiglu"}))


# Llama 3.1/3.2 RoPE scaling as megatron-core implements it (rope_scaling=True): only the factor varies.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_rope_factor(scaling: dict, where: str) -> float:
    """The factor of Llama 3's RoPE scaling (``rope_type: llama3``), or a ConfigError for any other."""
    kind = scaling.get("rope_type", scaling.get("type"))
    fixed_ok = all(scaling.get(k, v) == v and not isinstance(scaling.get(k), bool) for k, v in _LLAMA3_ROPE.items())
    if kind != "llama3" or not fixed_ok or "factor" not in scaling:
        raise ConfigError(f"{where}: RoPE scaling {scaling} is not supported (only Llama 3's 'llama3' type with "
                          f"{_LLAMA3_ROPE})")
    factor = _float_value(scaling, "factor", where, None, positive=True, name="rope_scaling.factor")
    if factor is None:
        raise ConfigError(f"{where}: rope_scaling.factor=None must be a positive number")
    return factor


def hf_config_from_nemo(cfg: dict) -> Tuple[str, dict]:
    """``(architecture, config.json dict)`` for a model config, or a ConfigError naming what does not fit."""
    norm, act, pos = cfg.get("normalization"), cfg.get("activation"), cfg.get("position_embedding_type")
    act = act[len("fast-"):] if isinstance(act, str) and act.startswith("fast-") else act  # same maths
    for key, plain in (("qk_layernorm", False), ("rotary_percentage", 1.0), ("seq_len_interpolation_factor", None)):
        value = cfg.get(key)
        if value is not None and value != plain and not (plain is None and value == 1):
            raise ConfigError(f"model.{key}={value}: Llama, Qwen2 and GPT-2 configs cannot express it, so the export "
                              "would compute something else")
    vocab = int(cfg.get("hf_vocab_size") or cfg["padded_vocab_size"])
    window = attention_window(cfg)
    if window is not None and not (norm == "rmsnorm" and not cfg.get("qkv_bias", False)):
        raise ConfigError(f"model.window_size={list(cfg['window_size'])}: of Llama, Mistral, Qwen2 and GPT-2 only "
                          "Mistral has a sliding window, and this model is not Mistral-shaped")
    if norm == "layernorm" and act in ("approx-gelu", "gelu") and pos == "learned_absolute" and cfg.get("bias", True) \
            and not cfg.get("layernorm_zero_centered_gamma"):
        if cfg.get("num_query_groups") not in (None, cfg["num_attention_heads"]):
            raise ConfigError("GPT-2 has no grouped-query attention (model.num_query_groups)")
        return "gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
                        "n_embd": cfg["hidden_size"], "n_layer": cfg["num_layers"], "n_head": cfg["num_attention_heads"],
                        "n_inner": cfg["ffn_hidden_size"], "n_positions": cfg["max_position_embeddings"],
                        "layer_norm_epsilon": cfg.get("layernorm_epsilon", 1e-5),
                        "activation_function": "quick_gelu" if act == "approx-gelu" else
                        ("gelu_new" if cfg.get("openai_gelu") else "gelu"),
                        "tie_word_embeddings": bool(cfg.get("share_embeddings_and_output_weights", True)),
                        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                        "initializer_range": cfg.get("init_method_std", 0.02), "torch_dtype": "float32"}
    gemma = act == "geglu" and cfg.get("openai_gelu") and cfg.get("apply_embedding_scaling")
    if norm == "rmsnorm" and (act == "swiglu" or gemma) and pos == "rope" and not cfg.get("bias", True):
        qkv_bias = bool(cfg.get("qkv_bias", False))
        if gemma and (qkv_bias or window is not None):
            raise ConfigError("a Gemma-shaped model (geglu, apply_embedding_scaling) with query/key/value biases or "
                              "a sliding window matches no Hugging Face architecture here")
        arch = "gemma" if gemma else ("qwen2" if qkv_bias else "llama")
        heads = cfg["num_attention_heads"]
        out = {"model_type": arch, "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"],
               "vocab_size": vocab, "hidden_size": cfg["hidden_size"], "intermediate_size": cfg["ffn_hidden_size"],
               "num_hidden_layers": cfg["num_layers"], "num_attention_heads": heads,
               "num_key_value_heads": cfg.get("num_query_groups") or heads,
               "head_dim": cfg.get("kv_channels") or cfg["hidden_size"] // heads,
               "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": float(cfg.get("rotary_base") or 10000),
               "rope_parameters": {"rope_theta": float(cfg.get("rotary_base") or 10000), "rope_type": "default"},
               "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5), "hidden_act": "silu",
               "tie_word_embeddings": bool(cfg.get("share_embeddings_and_output_weights", False)),
               "attention_dropout": 0.0, "initializer_range": cfg.get("init_method_std", 0.02), "torch_dtype": "float32"}
        moe = num_moe_experts(cfg) is not None
        if moe and (gemma or qkv_bias):
            raise ConfigError("a mixture-of-experts model exports as Mixtral, which has no "
                              f"{'GeGLU' if gemma else 'query/key/value biases'}")
        if arch == "llama" and not moe:
            out.update(attention_bias=False, mlp_bias=False)
        if gemma:
            out.update(model_type="gemma", architectures=["GemmaForCausalLM"], hidden_act="gelu_pytorch_tanh",
                       hidden_activation="gelu_pytorch_tanh", attention_bias=False)
        if moe:  # Mixtral: Llama's attention (and Mistral's window, if any) with routed experts
            arch = MIXTRAL
            out.update(_mixtral_config(cfg), model_type=MIXTRAL, architectures=["MixtralForCausalLM"],
                       sliding_window=None if window is None else window + 1)
        elif window is not None:  # Mistral: Llama's weights and names with a sliding window
            arch = "mistral"
            out.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window + 1)
        if cfg.get("scale_positional_embedding"):
            scaling = dict(_LLAMA3_ROPE, rope_type="llama3", factor=rope_scaling_factor(cfg))
            out["rope_scaling"] = scaling
            out["rope_parameters"] = dict(scaling, rope_theta=out["rope_theta"])
        return arch, out
    raise ConfigError(f"this model (normalization={norm}, activation={act}, position_embedding_type={pos}, "
                      f"bias={cfg.get('bias')}) matches none of {', '.join(ARCHITECTURES)}")


# MoE settings Mixtral's layer has no way to express: (key, the value it computes with).
_MIXTRAL_FIXED = (("moe_router_pre_softmax", False), ("moe_router_score_function", "softmax"),
                  ("moe_shared_expert_intermediate_size", None),
                  ("moe_router_topk_scaling_factor", None), ("moe_router_enable_expert_bias", False),
                  ("moe_router_num_groups", None), ("moe_apply_probs_on_input", False))


def _mixtral_config(cfg: dict) -> dict:
    """Mixtral's config.json keys for a model config's experts (a ConfigError for what it cannot hold)."""
    for key, plain in _MIXTRAL_FIXED:
        if cfg.get(key) not in (None, plain):
            raise ConfigError(f"model.{key}={cfg.get(key)!r}: Mixtral's config cannot express it, so the export "
                              "would compute something else")
    return {"num_local_experts": num_moe_experts(cfg), "num_experts_per_tok": int(cfg.get("moe_router_topk") or 2),
            "intermediate_size": int(cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"]),
            "router_aux_loss_coef": float(cfg.get("moe_aux_loss_coeff") or 0.0),
            "router_jitter_noise": float(cfg.get("moe_input_jitter_eps") or 0.0), "output_router_logits": False}


# ----------------------------------------------------------------------------- weights
def read_hf_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    state: Dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for path in files:
            try:
                state.update(load_file(path))
            except Exception as err:  # safetensors' own errors: a truncated file, a bad header
                raise CheckpointError(f"{path}: not a readable safetensors file ({err}); the download may be "
                                      "incomplete") from None
        return state
    bins = sorted(glob.glob(os.path.join(hf_dir, "pytorch_model*.bin")))
    if not bins:
        raise CheckpointError(f"{hf_dir}: no *.safetensors or pytorch_model*.bin weights")
    for path in bins:
        try:
            state.update(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as err:
            raise CheckpointError(f"{path}: cannot be read as a weights file ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''})") from None
    return state


def _fuse_qkv(q, k, v, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    per = heads // groups
    q = q.reshape(groups, per * head_dim, *q.shape[1:])
    k = k.reshape(groups, head_dim, *k.shape[1:])
    v = v.reshape(groups, head_dim, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _split_qkv(qkv, heads: int, groups: int, head_dim: int):
    per = heads // groups
    parts = qkv.reshape(groups, (per + 2) * head_dim, *qkv.shape[1:])
    q = parts[:, : per * head_dim].reshape(-1, *qkv.shape[1:])
    k = parts[:, per * head_dim : (per + 1) * head_dim].reshape(-1, *qkv.shape[1:])
    v = parts[:, (per + 1) * head_dim :].reshape(-1, *qkv.shape[1:])
    return q, k, v


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


class _ReadOnce(dict):
    """An HF state dict that remembers which tensors the conversion read, and names a missing one."""

    def __init__(self, state: Dict[str, torch.Tensor], where: str):
        super().__init__(state)
        self.where = where
        self.used = set()

    def __getitem__(self, key):
        if not super().__contains__(key):
            raise CheckpointError(f"{self.where}: the weights have no tensor {key!r} that this architecture needs")
        self.used.add(key)
        return super().__getitem__(key)

    def take(self, key: str, *dims: int) -> torch.Tensor:
        """Tensor ``key``, which must have the shape ``dims`` that config.json's sizes give."""
        tensor = self[key]
        if tuple(tensor.shape) != dims:
            raise CheckpointError(f"{self.where}: tensor {key!r} has shape {list(tensor.shape)}, but config.json's "
                                  f"sizes give {list(dims)}")
        return tensor


# Tensors an HF checkpoint may hold that carry no weights: attention-mask buffers, RoPE's inverse
# frequencies, and a tied model's copy of its embedding.
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _check_all_read(hf: _ReadOnce, tied: bool, embedding: str) -> None:
    """Every tensor was used, but for buffers and, where the embeddings are tied, a copy of the embedding."""
    if tied and "lm_head.weight" in hf and not torch.equal(dict.__getitem__(hf, "lm_head.weight"),
                                                           dict.__getitem__(hf, embedding)):
        raise CheckpointError(f"{hf.where}: tie_word_embeddings is true but lm_head.weight differs from {embedding}; "
                              "refusing to drop it (set tie_word_embeddings to false in config.json if the model "
                              "has its own output layer)")
    left = sorted(k for k in hf if k not in hf.used and not k.endswith(_NOT_WEIGHTS)
                  and not (tied and k.endswith("lm_head.weight")))
    if left:
        raise CheckpointError(f"{hf.where}: {len(left)} tensor(s) have no place in the converted model "
                              f"({', '.join(left[:4])}{' ...' if len(left) > 4 else ''}); refusing to drop them")


def hf_to_mcore(hf: Dict[str, torch.Tensor], arch: str, cfg: dict, where: str = "weights") -> Dict[str, torch.Tensor]:
    """HF state dict -> megatron-core ``GPTModel`` state dict (local layer spec names). Every HF tensor
    must have the shape config.json's sizes give and find its place (a CheckpointError names any
    misshapen, left over or missing)."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    groups = cfg.get("num_query_groups") or heads
    head_dim = cfg.get("kv_channels") or hidden // heads
    padded = cfg["padded_vocab_size"]
    tied = bool(cfg["share_embeddings_and_output_weights"])
    out: Dict[str, torch.Tensor] = {}
    if arch == "gpt2":
        hf = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in hf.items()}
    hf = _ReadOnce(hf, where)
    vocab, H, F, take = cfg.get("hf_vocab_size") or padded, hidden, cfg["ffn_hidden_size"], hf.take
    if arch == "gpt2":
        out["embedding.word_embeddings.weight"] = _pad_rows(take("wte.weight", vocab, H), padded)
        out["embedding.position_embeddings.weight"] = take("wpe.weight", cfg["max_position_embeddings"], H)
        for i in range(cfg["num_layers"]):
            p, o = f"h.{i}.", f"decoder.layers.{i}."
            w = take(p + "attn.c_attn.weight", H, 3 * H).t()  # Conv1D stores [in, out]
            b = take(p + "attn.c_attn.bias", 3 * H)
            out[o + "self_attention.linear_qkv.weight"] = _fuse_qkv(*w.split(hidden, 0), heads, heads, head_dim)
            out[o + "self_attention.linear_qkv.bias"] = _fuse_qkv(*b.split(hidden, 0), heads, heads, head_dim)
            out[o + "self_attention.linear_proj.weight"] = take(p + "attn.c_proj.weight", H, H).t()
            out[o + "self_attention.linear_proj.bias"] = take(p + "attn.c_proj.bias", H)
            for ln, name in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                out[o + name + ".weight"], out[o + name + ".bias"] = take(p + ln + ".weight", H), take(p + ln + ".bias", H)
            out[o + "mlp.linear_fc1.weight"] = take(p + "mlp.c_fc.weight", H, F).t()
            out[o + "mlp.linear_fc1.bias"] = take(p + "mlp.c_fc.bias", F)
            out[o + "mlp.linear_fc2.weight"] = take(p + "mlp.c_proj.weight", F, H).t()
            out[o + "mlp.linear_fc2.bias"] = take(p + "mlp.c_proj.bias", H)
        out["decoder.final_layernorm.weight"], out["decoder.final_layernorm.bias"] = take("ln_f.weight", H), take("ln_f.bias", H)
        if not tied:
            out["output_layer.weight"] = _pad_rows(take("lm_head.weight", vocab, H), padded)
        _check_all_read(hf, tied, "wte.weight")
        return {k: v.contiguous() for k, v in out.items()}
    Q, KV = heads * head_dim, groups * head_dim
    out["embedding.word_embeddings.weight"] = _pad_rows(take("model.embed_tokens.weight", vocab, H), padded)
    for i in range(cfg["num_layers"]):
        p, o = f"model.layers.{i}.", f"decoder.layers.{i}."
        att = p + "self_attn."
        out[o + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            take(att + "q_proj.weight", Q, H), take(att + "k_proj.weight", KV, H), take(att + "v_proj.weight", KV, H),
            heads, groups, head_dim)
        if cfg.get("qkv_bias"):
            out[o + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                take(att + "q_proj.bias", Q), take(att + "k_proj.bias", KV), take(att + "v_proj.bias", KV),
                heads, groups, head_dim)
        out[o + "self_attention.linear_proj.weight"] = take(att + "o_proj.weight", H, Q)
        out[o + "input_layernorm.weight"] = take(p + "input_layernorm.weight", H)
        out[o + "pre_mlp_layernorm.weight"] = take(p + "post_attention_layernorm.weight", H)
        if arch == MIXTRAL:  # w1: gate, w3: up, w2: down, per expert
            moe, count = p + "block_sparse_moe.", cfg["num_moe_experts"]
            out[o + "mlp.router.weight"] = take(moe + "gate.weight", count, H)
            for e in range(count):
                w, x = f"{moe}experts.{e}.", f"{o}mlp.experts.local_experts.{e}."
                out[x + "linear_fc1.weight"] = torch.cat([take(w + "w1.weight", F, H), take(w + "w3.weight", F, H)])
                out[x + "linear_fc2.weight"] = take(w + "w2.weight", H, F)
            continue
        out[o + "mlp.linear_fc1.weight"] = torch.cat([take(p + "mlp.gate_proj.weight", F, H),
                                                      take(p + "mlp.up_proj.weight", F, H)])
        out[o + "mlp.linear_fc2.weight"] = take(p + "mlp.down_proj.weight", H, F)
    out["decoder.final_layernorm.weight"] = take("model.norm.weight", H)
    if arch in _ONE_CENTRED_NORMS:
        for key in [k for k in out if k.endswith("layernorm.weight")]:
            out[key] = out[key] + 1.0
    if not tied:
        out["output_layer.weight"] = _pad_rows(take("lm_head.weight", vocab, H), padded)
    _check_all_read(hf, tied, "model.embed_tokens.weight")
    return {k: v.contiguous() for k, v in out.items()}


def mcore_to_hf(state: Dict[str, torch.Tensor], arch: str, cfg: dict) -> Dict[str, torch.Tensor]:
    """megatron-core ``GPTModel`` state dict -> HF state dict (the padded vocabulary rows dropped)."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    groups = cfg.get("num_query_groups") or heads
    head_dim = cfg.get("kv_channels") or hidden // heads
    vocab = int(cfg.get("hf_vocab_size") or cfg["padded_vocab_size"])
    tied = bool(cfg.get("share_embeddings_and_output_weights"))
    out: Dict[str, torch.Tensor] = {}
    if arch == "gpt2":
        out["transformer.wte.weight"] = state["embedding.word_embeddings.weight"][:vocab]
        out["transformer.wpe.weight"] = state["embedding.position_embeddings.weight"]
        for i in range(cfg["num_layers"]):
            o, p = f"decoder.layers.{i}.", f"transformer.h.{i}."
            q, k, v = _split_qkv(state[o + "self_attention.linear_qkv.weight"], heads, heads, head_dim)
            out[p + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()
            qb, kb, vb = _split_qkv(state[o + "self_attention.linear_qkv.bias"], heads, heads, head_dim)
            out[p + "attn.c_attn.bias"] = torch.cat([qb, kb, vb])
            out[p + "attn.c_proj.weight"] = state[o + "self_attention.linear_proj.weight"].t()
            out[p + "attn.c_proj.bias"] = state[o + "self_attention.linear_proj.bias"]
            for hf_name, name in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                out[p + hf_name + ".weight"], out[p + hf_name + ".bias"] = state[o + name + ".weight"], state[o + name + ".bias"]
            out[p + "mlp.c_fc.weight"] = state[o + "mlp.linear_fc1.weight"].t()
            out[p + "mlp.c_fc.bias"] = state[o + "mlp.linear_fc1.bias"]
            out[p + "mlp.c_proj.weight"] = state[o + "mlp.linear_fc2.weight"].t()
            out[p + "mlp.c_proj.bias"] = state[o + "mlp.linear_fc2.bias"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = (state["decoder.final_layernorm.weight"],
                                                                        state["decoder.final_layernorm.bias"])
        out["lm_head.weight"] = out["transformer.wte.weight"] if tied else state["output_layer.weight"][:vocab]
    else:
        out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"][:vocab]
        for i in range(cfg["num_layers"]):
            o, p = f"decoder.layers.{i}.", f"model.layers.{i}."
            q, k, v = _split_qkv(state[o + "self_attention.linear_qkv.weight"], heads, groups, head_dim)
            out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"], out[p + "self_attn.v_proj.weight"] = q, k, v
            if o + "self_attention.linear_qkv.bias" in state:
                qb, kb, vb = _split_qkv(state[o + "self_attention.linear_qkv.bias"], heads, groups, head_dim)
                out[p + "self_attn.q_proj.bias"], out[p + "self_attn.k_proj.bias"], out[p + "self_attn.v_proj.bias"] = qb, kb, vb
            out[p + "self_attn.o_proj.weight"] = state[o + "self_attention.linear_proj.weight"]
            out[p + "input_layernorm.weight"] = state[o + "input_layernorm.weight"]
            out[p + "post_attention_layernorm.weight"] = state[o + "pre_mlp_layernorm.weight"]
            if arch == MIXTRAL:
                out[p + "block_sparse_moe.gate.weight"] = state[o + "mlp.router.weight"]
                for e in range(cfg["num_moe_experts"]):
                    w, x = f"{p}block_sparse_moe.experts.{e}.", f"{o}mlp.experts.local_experts.{e}."
                    out[w + "w1.weight"], out[w + "w3.weight"] = state[x + "linear_fc1.weight"].chunk(2)
                    out[w + "w2.weight"] = state[x + "linear_fc2.weight"]
                continue
            gate, up = state[o + "mlp.linear_fc1.weight"].chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = state[o + "mlp.linear_fc2.weight"]
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
        if arch in _ONE_CENTRED_NORMS:
            for key in [k for k in out if k.endswith("norm.weight")]:
                out[key] = out[key] - 1.0
        if not tied:
            out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------- files
def _ensure_single_process_parallel_state() -> None:
    from megatron.core import parallel_state

    from nemo_aligner.utils import distributed as D

    D.init_distributed()
    if not parallel_state.model_parallel_is_initialized() or \
            parallel_state.get_tensor_model_parallel_world_size() != 1 or \
            parallel_state.get_pipeline_model_parallel_world_size() != 1:
        D.initialize_model_parallel(1, 1)


def read_json_object(path: str, where: str) -> dict:
    """The JSON object in the file ``path``; anything else is a ConfigError naming ``where``."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must hold a JSON object, got {type(value).__name__}")
    return value


def import_hf_model(hf_dir: str, nemo_path: str, precision: str = "32") -> str:
    """Convert a local HF model directory to a ``.nemo`` (rank 0 writes; every rank waits for it);
    ``precision`` (32, bf16 or 16, in any of NeMo's spellings): the dtype its weights are stored in."""
    import torch.distributed as dist
    from omegaconf import OmegaConf, open_dict

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.config_checks import precision_name
    from nemo_aligner.utils.nemo_file import save_nemo
    from nemo_aligner.utils.tokenizers import ByteTokenizer, build_tokenizer

    dtype = precision_name(precision)
    if dtype is None:
        raise ConfigError(f"precision={precision!r} is not one of 32, bf16, 16")
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(hf_dir):
        raise ConfigError(f"{hf_dir}: no such directory (nothing is downloaded: fetch the model first, e.g. "
                          f"`huggingface-cli download {hf_dir} --local-dir <dir>`, and give that directory)")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    arch, cfg = nemo_config_from_hf(read_json_object(config_path, config_path), config_path)
    if any(os.path.isfile(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        tok_cfg = {"library": "huggingface", "type": os.path.abspath(hf_dir)}
        tokenizer = build_tokenizer(tok_cfg)
    else:
        tokenizer = ByteTokenizer()
        tok_cfg = tokenizer.config()
        if tokenizer.vocab_size > cfg["hf_vocab_size"]:
            raise ConfigError(f"{hf_dir}: no tokenizer files, and the vocabulary ({cfg['hf_vocab_size']}) is too small "
                              f"for the built-in byte tokenizer ({tokenizer.vocab_size})")
        logger.warning("%s has no tokenizer files: using the built-in byte tokenizer", hf_dir)
    if tokenizer.vocab_size > cfg["hf_vocab_size"]:  # ids past the model's rows: lost again at export
        raise ConfigError(f"{hf_dir}: the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                          f"vocab_size={cfg['hf_vocab_size']}")
    # The weights are converted (and their shapes checked against config.json) before the model is built.
    state = hf_to_mcore({k: v.float() for k, v in read_hf_weights(hf_dir).items()}, arch, cfg, where=hf_dir)
    _ensure_single_process_parallel_state()
    # The local spec's parameter names are the ones converted here (Transformer Engine's fuse the layer
    # norms into the linears); the .nemo's sharded checkpoint loads into either spec.
    model_cfg = OmegaConf.create(dict(cfg, micro_batch_size=1, tokenizer=tok_cfg, force_local_spec=True))
    model = GPTSFTModel(model_cfg, tokenizer, dtype, trainable=False)
    with open_dict(model.cfg):
        model.cfg.pop("force_local_spec", None)
    result = model.module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{hf_dir}: converted weights do not fit the model: missing {missing[:4]}, "
                              f"unexpected {result.unexpected_keys[:4]}")
    path = save_nemo(model, nemo_path)
    if dist.is_initialized():
        dist.barrier()
    logger.info("imported %s (%s) to %s", hf_dir, arch, path)
    return path


# What save_pretrained writes for a causal LM and its tokenizer: an export may replace these.
_EXPORT_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", *TOKENIZER_FILE_NAMES}


def check_export_target(out_dir: str, written=_EXPORT_FILES, key: str = "--output-dir") -> None:
    """The export replaces ``out_dir`` whole: refuse a directory holding anything but the files an export
    writes (``written``, ``*.safetensors``: the user's files would go with it) or one the process stands in."""
    target = os.path.abspath(out_dir)
    if os.getcwd() == target or os.getcwd().startswith(target + os.sep):
        raise ConfigError(f"{key} {out_dir}: the export replaces the directory whole, so it cannot be the "
                          "current directory or one above it; give a new directory")
    if not os.path.isdir(target):
        if os.path.exists(target):
            raise ConfigError(f"{key} {out_dir} is a file, not a directory")
        return
    foreign = sorted(name for name in os.listdir(target)
                     if name not in written and not name.endswith(".safetensors"))
    if foreign:
        raise ConfigError(f"{key} {out_dir} holds files an export does not write ({', '.join(foreign[:5])}"
                          f"{' ...' if len(foreign) > 5 else ''}); the export replaces the directory whole, so give "
                          "a new or empty directory (or an earlier export)")


def _refuse_reward_heads(nemo_path: str) -> None:
    """A reward model's or critic's head has no place in a Hugging Face causal LM: refuse rather than
    write the body alone under a causal-LM config."""
    import pickle
    import tarfile

    from nemo_aligner.utils.nemo_file import MODEL_WEIGHTS, check_exists

    check_exists(nemo_path, "nemo_file")
    metadata = None  # torch DCP's index of the weights: tensor names without reading (or extracting) them
    try:
        if os.path.isdir(nemo_path):
            index = os.path.join(nemo_path, MODEL_WEIGHTS, ".metadata")
            if os.path.isfile(index):
                with open(index, "rb") as f:
                    metadata = pickle.load(f)
        else:
            with tarfile.open(nemo_path, "r:") as tar:
                member = next((m for m in tar if m.name.replace("./", "", 1) == f"{MODEL_WEIGHTS}/.metadata"), None)
                if member is not None:
                    metadata = pickle.load(tar.extractfile(member))
    except Exception:  # cut short, emptied or garbled (unpickling raises anything): loading the model names it
        return
    names = getattr(metadata, "state_dict_metadata", {}) or {}
    heads = sorted(k for k in names if ".rm_head." in f".{k}" and "_extra_state" not in k)
    if heads:
        raise ConfigError(f"{nemo_path} is a reward model or critic (it has {heads[0]}); a Hugging Face causal-LM "
                          "export would drop its reward head, so it is not exported")


def nemo_precision(nemo_path: str, key: str) -> str:
    """The precision a ``.nemo`` records ("32", "bf16" or "16"; "32" where it records none NeMo names)."""
    from nemo_aligner.utils.config_checks import precision_name
    from nemo_aligner.utils.nemo_file import read_model_config

    return precision_name(read_model_config(nemo_path, key).get("precision", 32)) or "32"


def export_to_hf(nemo_path: str, out_dir: Optional[str] = None, precision="32",
                 weights_file: Optional[str] = None) -> str:
    """Write a ``.nemo`` as a Hugging Face directory (config.json, model.safetensors, tokenizer files).

    ``precision`` (32, bf16 or 16, in any of NeMo's spellings): the dtype of the weights written;
    None: the ``.nemo``'s own.
    ``weights_file``: the weights also (or, without ``out_dir``, only) as one torch state dict in
    Hugging Face's names, the ``pytorch_model.bin`` NeMo's ``convert_*_nemo_to_hf.py`` writes to
    ``--output_path``."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    from nemo_aligner.models.nlp.gpt.gpt_builder import precision_dtype
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.checkpoint_io import recover_replaced_dir, replace_dir_atomically
    from nemo_aligner.utils.distributed import get_rank
    from nemo_aligner.utils.tokenizers.hf_export import NotExportable, write_hf_tokenizer

    dtype = precision_dtype(nemo_precision(nemo_path, "nemo_file") if precision is None else precision,
                            key="precision")
    if out_dir is None and weights_file is None:
        raise ConfigError("nothing to write: give an output directory, a weights file, or both")
    if out_dir is not None:
        check_export_target(out_dir)
    if weights_file is not None and (os.path.isdir(weights_file) or not os.path.isdir(
            os.path.dirname(os.path.abspath(weights_file)))):
        raise ConfigError(f"--output_path {weights_file}: a weights file is written there, so it must be a file "
                          "path in an existing directory")
    _refuse_reward_heads(nemo_path)
    _ensure_single_process_parallel_state()
    model = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 1, "tensor_model_parallel_size": 1,
                                                      "pipeline_model_parallel_size": 1,
                                                      "force_local_spec": True}),  # the names converted here
                       "32", nemo_path, key="nemo_file", trainable=False)
    cfg = OmegaConf.to_container(model.cfg, resolve=True)
    # as built (a null in the .nemo is NeMo's default, tied), so the config and the weights written agree
    cfg["share_embeddings_and_output_weights"] = bool(model.module.share_embeddings_and_output_weights)
    arch, hf_cfg = hf_config_from_nemo(cfg)
    hf_cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    if get_rank() != 0:
        return out_dir or weights_file
    state = {k: v.cpu() for k, v in model.module.state_dict().items() if isinstance(v, torch.Tensor)}
    hf_state = {k: v.to(dtype).contiguous() for k, v in mcore_to_hf(state, arch, cfg).items()}
    if weights_file is not None:
        torch.save(hf_state, weights_file + ".tmp")
        os.replace(weights_file + ".tmp", weights_file)
        logger.info("weights of %s written to %s", nemo_path, weights_file)
    if out_dir is None:
        return weights_file
    tmp = f"{out_dir.rstrip('/')}.tmp"
    recover_replaced_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(hf_state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tokenizer = model.tokenizer
    # The special-token ids generate() stops and pads with (a config without them falls back to the
    # architecture's defaults: Llama's eos 2, Qwen2's none).
    pad = getattr(tokenizer, "own_pad_id", None) if getattr(tokenizer, "library", "") == "huggingface" else None
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": pad}
    hf_cfg.update({k: v for k, v in ids.items() if v is not None})
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_cfg, f, indent=2)
    try:
        for caveat in write_hf_tokenizer(tokenizer, tmp, add_bos=arch in _ADDS_BOS):
            logger.warning("%s: %s", out_dir, caveat)
    except NotExportable as why:
        logger.warning("%s has weights and config only, no tokenizer files: %s", out_dir, why)
    if not os.path.exists(os.path.join(tmp, "generation_config.json")):
        from transformers import GenerationConfig

        GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(tmp)
    replace_dir_atomically(tmp, out_dir)  # an earlier export stays whole until the new one is in
    logger.info("exported %s as %s to %s", nemo_path, arch, out_dir)
    return out_dir


def resave_as_mcore(nemo_path: str, out_path: str) -> str:
    """Write any .nemo this project reads (NeMo's pre-megatron-core names, per-rank shards, zarr or
    torch_dist weights; a file or an extracted directory) as a megatron-core .nemo at TP=1, PP=1, in
    the checkpoint's own precision: what NeMo's ``convert_gpt_nemo_to_mcore.py`` makes."""
    from omegaconf import OmegaConf

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import save_nemo

    _refuse_reward_heads(nemo_path)
    precision = nemo_precision(nemo_path, "--input-name-or-path")
    _ensure_single_process_parallel_state()
    model = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 1, "tensor_model_parallel_size": 1,
                                                      "pipeline_model_parallel_size": 1}),
                       precision, nemo_path, key="--input-name-or-path", trainable=False)
    return save_nemo(model, out_path)

