"""Type and range checks of a run's config values, so a mistake names its key before anything runs.

Hydra passes a command-line value it cannot parse as a number through as a string
(``model.micro_batch_size=eight``); without this check the first ``int(...)`` deep inside a
trainer fails with a traceback that names no key. Keys are matched by their last component,
wherever they sit in the tree (``model.micro_batch_size``, ``model.data.train_ds.micro_batch_size``,
``trainer.ppo.inference_micro_batch_size`` ...).
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.preference_losses import REGRESSION_LOSSES

POSITIVE_INTS = frozenset({
    "micro_batch_size", "global_batch_size", "num_layers", "hidden_size", "ffn_hidden_size",
    "num_attention_heads", "encoder_seq_length", "max_position_embeddings", "max_seq_length", "seq_length",
    "devices", "num_nodes", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "rollout_micro_batch_size", "forward_micro_batch_size", "val_rollout_micro_batch_size",
    "inference_micro_batch_size", "num_rollout_samples", "num_val_samples", "num_responses_per_prompt",
    "num_generations_per_prompt", "max_batch_size", "make_vocab_size_divisible_by", "batch_size",
    "max_sequence_length", "max_train_rows", "log_prob_forward_micro_batch_size", "pad_to_multiple_of",
    "pad_length_to_multiple_of", "num_query_groups", "kv_channels", "activations_checkpoint_num_layers",
    "max_length", "max_rollout_turns", "num_rollouts_per_prompt", "top_n_rollouts", "num_attributes",
    "max_iterations", "dist_timeout_minutes", "strip_sequence_length_to_multiple", "padded_vocab_size",
    "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_num_groups",
    "moe_router_group_topk", "expert_model_parallel_size",
})
NON_NEGATIVE_INTS = frozenset({
    "critic_warmup_steps", "num_workers",
    "max_consecutive_nonfinite_steps", "min_length", "top_k", "max_retries", "tokens_to_generate",
    "min_tokens_to_generate", "seed", "max_queue_delay_microseconds", "start_from_idx", "end_at_idx",
    "num_moe_experts",
})
NON_NEGATIVE_NUMBERS = frozenset({
    "val_check_interval", "save_interval", "lr", "min_lr", "weight_decay", "gradient_clip_val", "temperature", "warmup_steps", "timeout_s",
    "hidden_dropout", "attention_dropout", "ffn_dropout", "initial_policy_kl_penalty", "reference_policy_kl_penalty",
    "ref_policy_kl_penalty", "sft_loss_weight", "preference_loss_weight", "gt_reward_scale", "constant_steps",
    "hold_steps", "warmup_ratio", "constant_ratio", "entropy_bonus", "ratio_eps", "discount_factor", "gae_lambda",
    "desirable_loss_weight", "undesirable_loss_weight", "kd_loss_weight", "loss_clip_val", "wait_for_server_s",
    "shutdown_idle_s", "top_p", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps",
    "moe_expert_capacity_factor", "moe_router_bias_update_rate",
})
# Any finite number (either sign).
FINITE_NUMBERS = frozenset({"default_chosen_reward", "default_rejected_reward", "mean", "loss_mask_val"})
# Keys a run cannot do without: null is an error (elsewhere null means "the default" or "off").
NOT_NULL = frozenset({"seed", "global_batch_size", "micro_batch_size", "gt_reward_scale", "sft_loss_weight", "preference_loss_weight",
                      "label_key", "ratio_eps", "discount_factor", "gae_lambda", "max_length",
                      "num_rollouts_per_prompt", "top_n_rollouts", "desirable_loss_weight", "undesirable_loss_weight",
                      "kd_loss_weight", "target_logits_scale", "logits_scale", "loss_clip_val", "shutdown_idle_s",
                      "num_rollout_samples", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "tokens_to_generate", "min_tokens_to_generate", "rollout_micro_batch_size",
                      "num_layers", "hidden_size", "num_attention_heads", "default_chosen_reward",
                      "default_rejected_reward", "initial_policy_kl_penalty", "batch_size", "ref_policy_kl_penalty",
                      "loss_mask_val", "max_iterations"})
# Text values (record field names, templates).
STRINGS = frozenset({"prompt_template", "label_key", "truncation_field"})
# One path each (a list or a number there would reach os.path as a list or a file descriptor).
PATHS = frozenset({"prompts_file", "output_file", "output_path", "gpt_model_file", "explicit_log_dir",
                   "restore_from_path", "workspace_dir", "triton_log_file"})
# One of a few values (null: off).
CHOICES = {
    "activations_checkpoint_granularity": ("full", "selective", None),
    "activations_checkpoint_method": ("uniform", "block", None),
    "loss_func": REGRESSION_LOSSES,  # a regression reward model's
    # mixture of experts (null: megatron-core's default)
    "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none", None),
    "moe_token_dispatcher_type": ("allgather", "alltoall", None),
    "moe_router_score_function": ("softmax", "sigmoid", None),
    "moe_token_drop_policy": ("probs", "position", None),
    "moe_router_dtype": ("fp32", "fp64", None),
}
# Probabilities that must stay below 1 (a dropout of 1 zeroes every activation).
UNIT_INTERVAL = frozenset({"hidden_dropout", "attention_dropout", "ffn_dropout"})
# At most 1: GAE's discount (gamma) and lambda, nucleus sampling's probability mass, the share of each
# head's dimensions RoPE rotates.
AT_MOST_ONE = frozenset({"discount_factor", "gae_lambda", "top_p", "rotary_percentage"})
# std: the reward model's reward_standardization.std; the scales divide knowledge distillation's logits;
# init_method_std: the spread of newly initialised weights (a reward head, a model built from scratch);
# seq_len_interpolation_factor: RoPE's position scaling (null: none); the architecture's norm epsilon and RoPE
# base, share and scaling factor (null: the default).
POSITIVE_NUMBERS = frozenset({"eps", "std", "target_logits_scale", "logits_scale", "init_method_std",
                              "seq_len_interpolation_factor", "layernorm_epsilon", "rotary_base", "rotary_percentage",
                              "rope_scaling_factor", "scale_factor", "low_freq_factor", "high_freq_factor",
                              "old_context_len", "moe_router_topk_scaling_factor"})
# Architecture flags: true, false or null (the default); text such as "false" would read as true.
BOOLEANS = frozenset({"bias", "qkv_bias", "share_embeddings_and_output_weights", "openai_gelu",
                      "layernorm_zero_centered_gamma", "qk_layernorm", "scale_positional_embedding", "rotary_interleaved",
                      "apply_query_key_layer_scaling", "headscale", "normalize_attention_scores", "megatron_legacy",
                      "apply_embedding_scaling", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
                      "moe_apply_probs_on_input", "moe_pad_expert_input_to_capacity", "moe_per_layer_logging",
                      "moe_token_dropping", "moe_shared_expert_gate", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm",
                      "moe_permute_fusion", "moe_router_fusion", "moe_layer_recompute", "moe_enable_deepep",
                      "moe_shared_expert_overlap"})
# TCP ports (null: not served / chosen freely).
PORTS = frozenset({"port", "grpc_port", "metrics_port"})
# Keys NeMo-Aligner's configs carry that this project does not implement: accepted at the value that
# means "off", an error otherwise (silently ignoring, say, a LoRA request would train every weight).
UNSUPPORTED_UNLESS = {
    "repetition_penalty": (1, 1.0, None),
    "add_BOS": (False, None),
    "all_probs": (False, None),
    "compute_logprob": (False, None),
}
# NeMo-Aligner keys of features this project lacks, matched by the end of their dotted path: refused
# unless at the value that means "off", with what to do instead.
REFUSED_UNLESS = {
    "peft.restore_from_ckpt.checkpoint_dir": ((None,), "LoRA adapters start from an adapters-only .nemo "
                                                       "(model.peft.restore_from_path); a run resumes from its own "
                                                       "checkpoints (exp_manager.resume_if_exists)"),
    "data.reset_position_ids": ((False,), "each sample is one document; set it to False"),
    "data.reset_attention_mask": ((False,), "each sample is one document; set it to False"),
    "data.eod_mask_loss": ((False,), "EOD tokens are trained like any other; set it to False"),
    "data.data_impl": (("jsonl", "json", "chunked_jsonl", "packed_jsonl", None),
                       "jsonl files are read (chunked_jsonl: knowledge distillation's records; packed_jsonl: DPO's "
                       ".npy packs); mmap/Megatron indexed data is not"),
    "fp8": ((False, None), "fp8 needs Transformer Engine's fp8 recipe, which is not supported; use "
                           "trainer.precision=bf16"),
    "kto.sft_loss_weight": ((0, None), "KTO has no SFT term here (NeMo-Aligner reads the key but does not apply it "
                                       "either)"),
    "kto.preference_loss_weight": ((1, None), "the KTO loss is not weighted (NeMo-Aligner reads the key but does "
                                              "not apply it either)"),
    "inference.model_name": (("reward_model",), "the reward-model server's PyTriton model is named reward_model"),
    "web_server": ((False,), "NeMo's Gradio web page is not available; server=True serves the REST API "
                             "(PUT /generate)"),
    "pipeline_model_parallel_split_rank": ((-1, 0, None), "it splits encoder-decoder models; a GPT model has no "
                                                          "split (-1 or 0)"),
}
# megatron_gpt_eval.py's top-level sizes that take -1, and what -1 means for each.
MINUS_ONE_KEEPS = {"tensor_model_parallel_size": "keep model.*", "pipeline_model_parallel_size": "keep model.*",
                   "expert_model_parallel_size": "keep model.*",
                   "micro_batch_size": "unused; prompts are generated batch_size at a time"}
# -1 (or null) means "no limit" for these.
INTS_OR_UNLIMITED = frozenset({"max_steps", "max_epochs"})
# Lightning's ``limit_*_batches``: a fraction (float <= 1.0) or a count (int; -1 or null: all).
BATCH_LIMITS = frozenset({"limit_train_batches", "limit_val_batches", "limit_test_batches"})
# One value, or in SPIN's section a list (its KL penalty: one per iteration, checked by its model).
VALUE_OR_LIST = frozenset({"ref_policy_kl_penalty"})
# Keys checked above that take one value: a list or dict there is an error, not a subtree.
SINGLE_VALUED = (POSITIVE_INTS | NON_NEGATIVE_INTS | NON_NEGATIVE_NUMBERS | POSITIVE_NUMBERS | FINITE_NUMBERS
                 | INTS_OR_UNLIMITED | BATCH_LIMITS | STRINGS | PATHS | PORTS | BOOLEANS | frozenset(CHOICES)
                 | frozenset(UNSUPPORTED_UNLESS)
                 | {"attribute_weights"}) - VALUE_OR_LIST


# NeMo/Lightning spellings of each precision.
PRECISIONS = {"32": ("32", "32-true", "fp32", "float32"), "bf16": ("bf16", "bf16-mixed", "bf16-true", "bfloat16"),
              "16": ("16", "16-mixed", "fp16", "float16")}


def precision_name(value) -> Optional[str]:
    """A precision value (32, 16, bf16, bf16-mixed, float32, ...) as "32", "bf16" or "16"; None for others."""
    text = str(value).lower()
    return next((name for name, spellings in PRECISIONS.items() if text in spellings), None)


def _leaves(node, prefix: str, interpolated: bool = False) -> Iterator[Tuple[str, object, bool]]:
    """``(dotted path, value, whether an interpolation gave it)`` of every scalar, and of a list or
    dict given where a checked key takes a single value (``model.micro_batch_size=[1]`` is an error
    naming it, not a skipped leaf)."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            try:
                value = node[key]
            except Exception:  # a missing value ('???') or an interpolation that cannot resolve yet
                continue
            from_interpolation = interpolated or OmegaConf.is_interpolation(node, key)
            if isinstance(value, (DictConfig, ListConfig)) and str(key) in SINGLE_VALUED | VALUE_OR_LIST:
                yield path, value, from_interpolation
            else:
                yield from _leaves(value, path, from_interpolation)
    elif not isinstance(node, ListConfig):
        yield prefix, node, interpolated


def type_name(value) -> str:
    """A config value's kind for a message: "a list", "a dict", or the Python type's name."""
    if isinstance(value, DictConfig):
        return "a dict"
    if isinstance(value, ListConfig):
        return "a list"
    return type(value).__name__


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_off(value, allowed) -> bool:
    """Whether ``value`` is one of ``allowed`` (strings case-blind; True is not 1)."""
    if isinstance(value, str):
        return value.lower() in {a.lower() for a in allowed if isinstance(a, str)}
    return any(value is a if a is None or isinstance(a, bool) else
               (not isinstance(value, bool) and isinstance(value, (int, float)) and value == a) for a in allowed)


def check_config_values(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` naming the first key whose value has the wrong type or range."""
    # Values set directly first: a bad ``model.seed`` is named as itself, not as the key that copies
    # it (``trainer.ppo.trt_llm.seed: ${model.seed}``).
    for path, value, _ in sorted(_leaves(cfg, ""), key=lambda leaf: leaf[2]):
        name = path.rsplit(".", 1)[-1]
        refused = next((suffix for suffix in REFUSED_UNLESS if path == suffix or path.endswith("." + suffix)), None)
        if refused is not None:
            allowed, instead = REFUSED_UNLESS[refused]
            if not _is_off(value, allowed):
                raise ConfigError(f"{path}={value!r} is not supported: {instead}")
            continue
        if name in VALUE_OR_LIST and isinstance(value, (DictConfig, ListConfig)):
            if isinstance(value, ListConfig) and ".spin." in f".{path}":
                continue  # SPIN's one beta per iteration: checked by its model
            raise ConfigError(f"{path}={shown(value)} must be one number, got {type_name(value)} (a list, one value "
                              "per iteration, is for SPIN)")
        if path == "model.global_batch_size" and value == 0 and "inference" in cfg:
            continue  # NeMo-Aligner's inference_rm.yaml: 0 turns off NeMo's micro-batch calculator
        if name in UNSUPPORTED_UNLESS:
            allowed = UNSUPPORTED_UNLESS[name]
            if not _is_off(value, allowed):
                raise ConfigError(f"{path}={value!r} is not supported (NeMo-Aligner's key is accepted only as "
                                  f"{allowed[0]!r}, i.e. off)")
            continue
        if value is None:
            # inference_rm.yaml: a null batch size there means "from inference.*" (or NeMo's calculator off)
            if name in NOT_NULL and not (name in ("global_batch_size", "micro_batch_size") and "inference" in cfg):
                raise ConfigError(f"{path}=null: this key needs a value")
            continue
        if path in MINUS_ONE_KEEPS and value == -1 and not isinstance(value, bool):
            continue
        if name in POSITIVE_INTS or name in NON_NEGATIVE_INTS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{path}={shown(value)} must be an integer, got {type_name(value)}")
            if name in POSITIVE_INTS and value <= 0:
                raise ConfigError(f"{path}={value} must be > 0"
                                  + (f" (or -1: {MINUS_ONE_KEEPS[path]})" if path in MINUS_ONE_KEEPS else ""))
            if name in NON_NEGATIVE_INTS and value < 0:
                raise ConfigError(f"{path}={value} must be >= 0")
        elif name in INTS_OR_UNLIMITED:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{path}={shown(value)} must be an integer (-1 or null: no limit), got "
                                  f"{type_name(value)}")
        elif name in BATCH_LIMITS:
            if not _is_number(value):
                raise ConfigError(f"{path}={shown(value)} must be a fraction (0.0-1.0) or a batch count "
                                  f"(-1 or null: all), got {type_name(value)}")
            if isinstance(value, float) and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{path}={value} must be a fraction between 0.0 and 1.0, or an integer count")
            if name == "limit_train_batches" and value == 0:
                raise ConfigError(f"{path}={value} leaves no training batches; use a positive count or fraction, "
                                  "or -1 / 1.0 for all")
        elif name in NON_NEGATIVE_NUMBERS or name in POSITIVE_NUMBERS or name in FINITE_NUMBERS:
            if not _is_number(value):
                raise ConfigError(f"{path}={shown(value)} must be a number, got {type_name(value)}")
            if not math.isfinite(value):  # lr=inf or nan trains to an all-NaN model
                raise ConfigError(f"{path}={value} must be a finite number")
            if name in FINITE_NUMBERS:
                continue
            if value < 0 or (name in POSITIVE_NUMBERS and value == 0):
                raise ConfigError(f"{path}={value} must be {'> 0' if name in POSITIVE_NUMBERS else '>= 0'}")
            if name in UNIT_INTERVAL and value >= 1:
                raise ConfigError(f"{path}={value} must be < 1 (a probability; 1 drops everything)")
            if name in AT_MOST_ONE and value > 1:
                raise ConfigError(f"{path}={value} must be between 0 and 1")
        elif name in BOOLEANS:
            if not isinstance(value, bool):
                raise ConfigError(f"{path}={shown(value)} must be true or false, got {type_name(value)}")
        elif name in PORTS:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
                raise ConfigError(f"{path}={shown(value)} must be a TCP port, 1-65535")
        elif name in STRINGS:
            if not isinstance(value, str):
                raise ConfigError(f"{path}={shown(value)} must be text, got {type_name(value)}")
        elif name in PATHS:
            if not isinstance(value, str):
                hint = f" (quote a name made of digits: {name}='{value}')" if _is_number(value) else ""
                raise ConfigError(f"{path}={shown(value)} must be one path, got {type_name(value)}{hint}")
        elif name in CHOICES:
            if isinstance(value, (DictConfig, ListConfig)) or value not in CHOICES[name]:
                raise ConfigError(f"{path}={shown(value)} must be one of "
                                  f"{', '.join('null' if c is None else c for c in CHOICES[name])}")
        elif name == "attribute_weights":
            items = list(value) if isinstance(value, ListConfig) else None
            if items is None or not all(_is_number(w) and math.isfinite(w) for w in items):
                raise ConfigError(f"{path}={shown(value)} must be a list of numbers (one weight per attribute) "
                                  "or null")
        elif isinstance(value, float) and math.isnan(value):  # never a setting: NaN spreads into every weight
            raise ConfigError(f"{path}=nan is not a number")
    _check_lists(cfg, "")


def shown(value) -> str:
    """A config value as the user would write it on the command line."""
    if isinstance(value, (DictConfig, ListConfig)):
        return str(OmegaConf.to_container(value, resolve=False))
    return repr(value)


def _check_lists(node, prefix: str) -> None:
    """The list-valued keys: ``*.optim.betas``, two finite numbers in [0, 1) (Adam's moment decay
    rates); ``end_strings``, a list of strings (one string: a list of one; a dict or a list of lists
    is an error, where iterating it would make an end string of each key or character)."""
    if not isinstance(node, DictConfig):
        return
    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        try:
            value = node[key]
        except Exception:
            continue
        if key == "betas" and prefix.endswith("optim") and value is not None:
            items = list(value) if isinstance(value, ListConfig) else None
            if (items is None or len(items) != 2 or
                    not all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and 0 <= b < 1
                            for b in items)):
                given = list(items) if items is not None else value
                raise ConfigError(f"{path}={given!r} must be two numbers in [0, 1), e.g. [0.9, 0.98]")
        elif key == "end_strings" and value is not None and not isinstance(value, str):
            if not isinstance(value, ListConfig) or any(isinstance(v, (DictConfig, ListConfig)) or v is None
                                                        for v in value):
                raise ConfigError(f"{path}={shown(value)} must be a list of strings, e.g. ['<extra_id_1>']")
            if any(isinstance(v, str) and v == "" for v in value):
                raise ConfigError(f"{path}={shown(value)} holds an empty string, which every text ends with: each "
                                  "response would stop after its first token")
        else:
            _check_lists(value, path)



def check_run_limits_keys(cfg: DictConfig) -> None:
    """``trainer.max_steps``/``max_epochs`` follow ``trainer.<algorithm>.*`` (the keys the trainers
    read, as in NeMo-Aligner); a value set on the top-level key would be ignored silently, so it is
    an error naming the key to set."""
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig):
        return
    for key in ("max_steps", "max_epochs"):
        if key not in trainer or OmegaConf.is_interpolation(trainer, key):
            continue
        sections = [name for name in trainer if isinstance(trainer.get(name), DictConfig) and key in trainer[name]]
        if len(sections) != 1:
            continue
        given, read = trainer.get(key), trainer[sections[0]].get(key)
        if given != read:
            raise ConfigError(f"trainer.{key}={given} is not read: this run's limit is trainer.{sections[0]}.{key} "
                              f"(now {read}); set that key instead")
