"""Which model keys a restored checkpoint decides, and how its config meets the run's."""

from __future__ import annotations

import logging
from typing import Iterable

from omegaconf import DictConfig, OmegaConf, open_dict

from nemo_aligner.utils.config_checks import check_config_values
from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)

# Keys that fix the shape of the weights: a restored checkpoint's values win over the run config.
ARCHITECTURE_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "max_position_embeddings", "position_embedding_type", "normalization", "activation", "bias", "qkv_bias",
    "share_embeddings_and_output_weights", "rotary_percentage", "rotary_base", "layernorm_epsilon",
    "make_vocab_size_divisible_by", "padded_vocab_size", "qk_layernorm", "tokenizer",
    "scale_positional_embedding", "rope_scaling_factor", "openai_gelu", "layernorm_zero_centered_gamma",
    "rotary_interleaved", "apply_query_key_layer_scaling", "transformer_block_type", "headscale",
    "normalize_attention_scores", "num_moe_experts", "window_size", "window_attn_skip_freq", "megatron_legacy",
    "scale_factor", "low_freq_factor", "high_freq_factor", "old_context_len", "apply_embedding_scaling",
    "mcore_customization_config",
    # mixture of experts: the routing and the experts' shapes
    "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_layer_freq", "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk_scaling_factor",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_apply_probs_on_input",
)
# Keys a checkpoint sets unless the run sets them (null in the shipped configs: "the checkpoint's").
CHECKPOINT_UNLESS_SET = ("encoder_seq_length", "seq_len_interpolation_factor", "hidden_dropout", "attention_dropout",
                         "ffn_dropout")
# Keys a reward model's head was trained with: the run's value wins (as in NeMo), with a warning when it
# differs from a reward-model checkpoint's, since the head then reads features it was not trained on.
HEAD_KEYS = ("use_avg_pool",)
# Keys describing the checkpoint itself, never copied into a new model's config.
_CHECKPOINT_ONLY = ("mcore_gpt", "dist_ckpt_format", "target", "precision", "nemo_version", "transformer_engine",
                    # the saving run's layout of the experts: the checkpoint loads at any layout
                    "expert_model_parallel_size", "expert_tensor_parallel_size")
# The model.* keys this process's command line set (``record_command_line``): an architecture value
# the checkpoint overrides is named in a warning when the user asked for it; the shipped configs'
# tiny-model shape (for models built from scratch) is overridden silently.
_COMMAND_LINE_MODEL_KEYS = set()


def record_command_line(keys: Iterable[str]) -> None:
    """Remember which ``model.*`` keys the command line set (``a.b`` keys, as ``override_keys`` gives)."""
    _COMMAND_LINE_MODEL_KEYS.clear()
    _COMMAND_LINE_MODEL_KEYS.update(key[len("model."):] for key in keys if key.startswith("model."))


def sequence_parallel_on(model_cfg) -> bool:
    """``model.sequence_parallel`` as NeMo applies it: with tensor parallelism only (NeMo turns it off at
    ``tensor_model_parallel_size=1``, where there is nothing to split over, so a config or checkpoint
    that sets it runs at TP=1 everywhere)."""
    tp = model_cfg.get("tensor_model_parallel_size", 1)
    return bool(model_cfg.get("sequence_parallel", False)) and int(tp if tp is not None else 1) > 1


def merge_checkpoint_config(ckpt_cfg: DictConfig, run_cfg: DictConfig,
                            architecture_keys: Iterable[str] = ARCHITECTURE_KEYS) -> DictConfig:
    """The run's ``model.*`` on top of the checkpoint's config, except for architecture keys.

    This mirrors NeMo-Aligner (the run config overrides the restored one) while keeping
    a checkpoint loadable when the run config still carries the tiny built-in shape.
    """
    base = OmegaConf.to_container(ckpt_cfg, resolve=True)
    if not base.get("mcore_gpt", False):
        base.pop("name", None)  # NeMo's older (not megatron-core) GPT never read it as a layer spec
    for key in _CHECKPOINT_ONLY:
        base.pop(key, None)
    for key in CHECKPOINT_UNLESS_SET:
        if run_cfg.get(key) is None and base.get(key) is not None:
            check_checkpoint_value(key, base[key])
            # the checkpoint's value, before the run's interpolations resolve (``length_params.max_length:
            # ${int_div:${model.encoder_seq_length}, 2}`` with ``encoder_seq_length: null``)
            with open_dict(run_cfg):
                run_cfg[key] = base[key]
    run = OmegaConf.to_container(run_cfg, resolve=True)
    drop_overwritten(base, run.pop("overwrite_base_config", None) or {})
    ignored = []
    for key in architecture_keys:
        if key in run and key in base and run[key] is not None and run[key] != base[key] and key != "tokenizer":
            ignored.append((key, f"model.{key}={run[key]} (the checkpoint has {base[key]})"))
        run.pop(key, None)
    asked = [text for key, text in ignored if key in _COMMAND_LINE_MODEL_KEYS]
    if asked:
        logger.warning("the checkpoint's architecture wins over %s: architecture keys shape a model built from "
                       "scratch only", ", ".join(asked))
    if ignored:
        logger.debug("the checkpoint's architecture over the config's: %s", ", ".join(text for _, text in ignored))
    for key in CHECKPOINT_UNLESS_SET:
        if run.get(key) is None:
            run.pop(key, None)  # null: keep the checkpoint's value
        elif base.get(key) is not None and run[key] != base[key]:
            logger.info("model.%s=%s set by the run (the checkpoint's is %s)", key, run[key], base[key])
    warn_head_keys(base, run)
    merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(run))
    return merged


def check_checkpoint_value(key: str, value) -> None:
    """Refuse a checkpoint's bad ``key`` value as the checkpoint's (it is copied into the run config,
    whose checks would otherwise name it as the run's ``model.<key>``)."""
    try:
        check_config_values(OmegaConf.create({"model": {key: value}}))
    except ConfigError as err:
        raise ConfigError(f"{err} (the checkpoint's model_config.yaml value: set model.{key} to override it)") from None


def warn_head_keys(base: dict, run: dict) -> None:
    """Warn for each :data:`HEAD_KEYS` value of the run that differs from a reward-model checkpoint's."""
    if "reward_model_type" not in base:  # no reward head in the checkpoint (an SFT model)
        return
    for key in HEAD_KEYS:
        if key in base and key in run and run[key] is not None and run[key] != base[key]:
            logger.warning("model.%s=%s differs from the reward-model checkpoint's %s, which its head was trained "
                           "with: pass model.%s=%s to keep it", key, run[key], base[key], key, base[key])


def drop_overwritten(base: dict, overwrite: dict) -> None:
    """NeMo-Aligner's ``model.overwrite_base_config``: every subtree marked True (``optim: True``,
    ``data: {data_prefix: True}``) is taken from the run's config alone, not merged over the
    checkpoint's."""
    for key, flag in overwrite.items():
        if isinstance(flag, dict):
            if isinstance(base.get(key), dict):
                drop_overwritten(base[key], flag)
        elif flag:
            base.pop(key, None)


def check_architecture_values(cfg) -> None:
    """The architecture keys' types and ranges (``model.ffn_hidden_size=-1`` names the key rather than
    failing inside megatron-core). These come from the checkpoint's model_config.yaml when restoring,
    after the run config's own checks."""
    from nemo_aligner.utils.config_checks import NOT_NULL

    def get(key):
        return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)

    # init_method_std: a restored model's new weights (a reward head) start from the checkpoint's spread
    keys = [key for key in ARCHITECTURE_KEYS + ("init_method_std",) if key != "tokenizer"]
    # null or absent is the default, except for the sizes nothing can default (they are then refused)
    values = {key: get(key) for key in keys if get(key) is not None or key in NOT_NULL}
    values = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in values.items()}
    try:
        check_config_values(OmegaConf.create({"model": values}))
    except ConfigError as err:
        raise ConfigError(f"{err} (when restoring, architecture values come from the checkpoint's "
                          "model_config.yaml)") from None
