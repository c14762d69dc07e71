"""Build a megatron-core ``GPTModel`` from NeMo's model config keys."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from nemo_aligner.utils.config_checks import check_config_values, precision_name
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.model_config import check_architecture_values, sequence_parallel_on

logger = logging.getLogger(__name__)

_POSITION_EMBEDDINGS = {"rope", "learned_absolute"}
# NeMo's normalization names; layernorm1p is LayerNorm with a zero-centred gamma (weight + 1).
_NORMALIZATIONS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm", "layernorm1p": "LayerNorm"}


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's ``gelu_new``; NeMo's ``gelu`` with ``openai_gelu: True``)."""
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """NeMo's ``approx-gelu``: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


# NeMo's activation names (nemo/collections/nlp/parts/utils_funcs.py: activation_to_func); the
# "fast-" gated units are the same maths (megatron-core fuses both halves into one fc1).
_ACTIVATIONS = {
    "gelu": (F.gelu, False),
    "approx-gelu": (quick_gelu, False),
    "squared-relu": (squared_relu, False),
    "relu": (F.relu, False),
    "swiglu": (F.silu, True),
    "fast-swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
    "fast-geglu": (F.gelu, True),
    "reglu": (F.relu, True),
    "fast-reglu": (F.relu, True),
}


def activation_from_cfg(cfg):
    """``(activation function, gated)`` as NeMo picks them; ``openai_gelu: True`` wins over the name."""
    act = str(_get(cfg, "activation", "gelu")).lower()
    if act not in _ACTIVATIONS:
        raise ConfigError(f"model.activation={act!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})")
    func, gated = _ACTIVATIONS[act]
    if bool(_get(cfg, "openai_gelu", False)):
        func = openai_gelu
    return func, gated


def zero_centered_gamma(cfg) -> bool:
    """NeMo's ``normalization: layernorm1p`` (or ``layernorm_zero_centered_gamma: True``)."""
    return str(_get(cfg, "normalization", "layernorm")).lower() == "layernorm1p" or \
        bool(_get(cfg, "layernorm_zero_centered_gamma", False))


def precision_dtype(precision, key: str = "trainer.precision") -> torch.dtype:
    """NeMo/Lightning precision values (32, 16, bf16, bf16-mixed, float32, ...) to a dtype; ``key``
    names the setting in the error."""
    name = precision_name(precision)
    if name is not None:
        return {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}[name]
    raise ConfigError(f"{key}={precision!r} is not one of 32, bf16, 16")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """NeMo/Megatron vocab padding: a multiple of ``make_vocab_size_divisible_by * TP``."""
    multiple = max(int(divisible_by or 1), 1) * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def te_available() -> bool:
    """Transformer Engine is used only when it imports and a GPU is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: F401
    except Exception:
        return False
    return True


def _get(cfg, key, default=None):
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


# NeMo architecture keys whose other values this project does not compute: (key, NeMo's default, allowed).
_UNSUPPORTED_ARCHITECTURE = (
    ("transformer_block_type", "pre_ln", ("pre_ln",)),
    ("rotary_interleaved", False, (False,)),
    ("headscale", False, (False,)),
    ("normalize_attention_scores", True, (True,)),
    ("window_attn_skip_freq", None, (None,)),  # the sliding window applies to every layer
    ("megatron_legacy", False, (False,)),  # all-Q-then-K-then-V query_key_value layout
)


# NeMo's Llama 3.x RoPE scaling keys (MegatronGPTModel's apply_rope_scaling) and the values
# megatron-core's rope_scaling computes with.
_ROPE_SCALING_FIXED = (("low_freq_factor", 1), ("high_freq_factor", 4), ("old_context_len", 8192))
# Gemma 2's and Falcon's customisations (NeMo's Gemma2 and Falcon layer specs), none computed here.
_UNSUPPORTED_CUSTOMIZATION = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                              "new_decoder_architecture", "parallel_attention")
# NeMo picks the layer spec by ``model.name``: the first compute the GPT layer (local or TE), the
# others layers of their own.
_GPT_LAYER_SPECS = ("", "te_gpt", "megatron_gpt_full_te_layer_autocast", "modelopt", "ammo")
_OTHER_LAYER_SPECS = ("megatron_falcon_gpt", "megatron_gemma2", "te_gpt_hyena", "decoder_block_gpt")


def rope_scaling_factor(cfg) -> float:
    """The Llama 3.x RoPE scaling factor: NeMo's ``scale_factor`` (default 8), or this project's earlier
    name ``rope_scaling_factor``; the other factors must be the ones megatron-core computes with."""
    for key, fixed in _ROPE_SCALING_FIXED:
        value = _get(cfg, key, fixed)
        if value != fixed:
            raise ConfigError(f"model.{key}={value!r} is not supported with model.scale_positional_embedding=True "
                              f"(only {fixed}, Llama 3.1/3.2's)")
    return float(_get(cfg, "scale_factor", None) or _get(cfg, "rope_scaling_factor", 8.0))


def check_supported_architecture(cfg) -> None:
    """Refuse, naming the key, a checkpoint architecture that would otherwise be computed wrongly."""
    spec = _get(cfg, "name", "") or ""  # null: absent
    if spec in _OTHER_LAYER_SPECS:
        raise ConfigError(f"model.name={spec!r} is not supported: NeMo builds that model's layers with its own layer "
                          f"spec (supported: the GPT layer, model.name absent or one of {list(_GPT_LAYER_SPECS)})")
    if spec not in _GPT_LAYER_SPECS:  # as NeMo's megatron-core GPT, which raises on a name it has no spec for
        raise ConfigError(f"model.name={spec!r} is not a layer spec NeMo knows (it picks the layers: absent or "
                          f"one of {list(_GPT_LAYER_SPECS)} for the GPT layer)")
    custom = _get(cfg, "mcore_customization_config", {}) or {}
    if not hasattr(custom, "items"):
        raise ConfigError(f"model.mcore_customization_config={custom!r} must be a mapping of NeMo's layer "
                          "customisations (or null)")
    for key in _UNSUPPORTED_CUSTOMIZATION:
        value = custom.get(key)
        if value:
            raise ConfigError(f"model.mcore_customization_config.{key}={value!r} is not supported (Gemma 2's and "
                              "Falcon's layer customisations are not computed here)")
    for key, default, allowed in _UNSUPPORTED_ARCHITECTURE:
        value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
        if value is None and None in allowed:
            continue
        if value not in [a for a in allowed if a is not None]:
            raise ConfigError(f"model.{key}={value!r} is not supported (supported: "
                              f"{', '.join(repr(a) for a in allowed)})")


# Mixture of experts. NeMo's MegatronGPTModel passes every TransformerConfig field it finds in the
# model config, with these defaults where they differ from megatron-core's.
_MOE_NEMO_DEFAULTS = {"moe_router_topk": 2, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0}
# GPU kernel choices, not maths: the experts run as megatron-core's SequentialMLP, whose checkpoint
# layout the grouped-GEMM experts share (megatron-core keeps them compatible).
_MOE_KERNEL_CHOICES = ("moe_grouped_gemm", "moe_use_legacy_grouped_gemm", "moe_permute_fusion", "moe_router_fusion",
                       "moe_enable_deepep", "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm",
                       "moe_layer_recompute", "moe_router_padding_for_fp8", "moe_router_padding_for_quantization")


def num_moe_experts(cfg) -> Optional[int]:
    """NeMo's ``num_moe_experts``: None for a dense MLP (absent, null or 0), else the experts per
    MoE layer (1 too: NeMo then builds a routed layer with one expert, as its checkpoints hold)."""
    value = _get(cfg, "num_moe_experts")
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"model.num_moe_experts={value!r} must be a whole number of experts (or null: no experts)")
    return value


def _check_moe_values(kwargs: dict) -> None:
    """The MoE settings' types, ranges and choices (the config rules; a checkpoint's values too), then
    what they must satisfy together, which megatron-core would take and fail on in the first forward."""
    check_config_values(OmegaConf.create({"model": {k: v for k, v in kwargs.items() if k != "moe_layer_freq"}}))
    freq = kwargs.get("moe_layer_freq", 1)
    if not (isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1) and not (
            isinstance(freq, list) and freq and all(v in (0, 1) and not isinstance(v, bool) for v in freq)):
        raise ConfigError(f"model.moe_layer_freq={freq!r} must be a whole number >= 1 (every n-th layer routed) or "
                          "a list of 0/1 per layer")
    experts, topk = kwargs["num_moe_experts"], kwargs["moe_router_topk"]  # positive ints by the rules
    if topk > experts:
        raise ConfigError(f"model.moe_router_topk={topk!r} must be a whole number from 1 to model.num_moe_experts="
                          f"{experts} (the experts each token is sent to)")
    if (topk == 1 and not kwargs.get("moe_router_pre_softmax") and kwargs.get("moe_router_score_function") in
            (None, "softmax") and kwargs.get("moe_router_load_balancing_type") != "sinkhorn"):
        # megatron-core's rule: a softmax over the one chosen logit is always 1, so the router gets no gradient
        raise ConfigError("model.moe_router_topk=1 needs model.moe_router_pre_softmax=True (the softmax over all "
                          "experts' logits before choosing one; after it, the one weight is always 1)")
    if kwargs.get("moe_apply_probs_on_input") and topk != 1:
        raise ConfigError(f"model.moe_apply_probs_on_input=True needs model.moe_router_topk=1 (it is {topk})")


def moe_config_kwargs(cfg) -> dict:
    """TransformerConfig keywords for NeMo's mixture-of-experts keys (``num_moe_experts`` and the
    ``moe_*`` fields); empty for a dense model."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = num_moe_experts(cfg)
    if experts is None:
        return {}
    if _get(cfg, "tensor_model_parallel_size", 1) != 1 and not _get(cfg, "sequence_parallel", False):
        raise ConfigError(f"model.tensor_model_parallel_size={_get(cfg, 'tensor_model_parallel_size')} with a mixture "
                          "of experts needs model.sequence_parallel=True (megatron-core's rule; it needs Transformer "
                          "Engine on a GPU), or 1 (pipeline parallelism works without it)")
    etp = _get(cfg, "expert_tensor_parallel_size")
    if etp is not None and etp != _get(cfg, "tensor_model_parallel_size", 1):
        raise ConfigError(f"model.expert_tensor_parallel_size={etp!r} must equal model.tensor_model_parallel_size "
                          "here (or be null)")
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    # the run's expert-parallel size (MegatronGPTModel sets it from megatron-core's parallel state)
    kwargs = dict(_MOE_NEMO_DEFAULTS, num_moe_experts=experts,
                  expert_model_parallel_size=_get(cfg, "expert_model_parallel_size", 1))
    unused = []
    for key in (cfg.keys() if hasattr(cfg, "keys") else ()):
        if not (key.startswith("moe_") or key == "overlap_moe_expert_parallel_comm") or key not in fields:
            continue
        value = _get(cfg, key)
        if value is None:
            continue
        if key in _MOE_KERNEL_CHOICES:
            if value:
                unused.append(f"{key}={value!r}")
            continue
        kwargs[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    _check_moe_values(kwargs)
    if kwargs.get("moe_token_dispatcher_type") == "alltoall" and not torch.cuda.is_available():
        # megatron-core's all-to-all dispatcher builds CUDA streams; with every expert on each rank the
        # all-gather dispatcher routes the same tokens to the same experts
        kwargs["moe_token_dispatcher_type"] = "allgather"
        logger.info("model.moe_token_dispatcher_type=alltoall: megatron-core's all-gather dispatcher is used "
                    "on the CPU (the same routing)")
    if unused:
        logger.warning("model.%s: not used here; the experts run as megatron-core's SequentialMLP (the same "
                       "maths and checkpoint layout)", ", model.".join(unused))
    freq = kwargs.get("moe_layer_freq", 1)
    if freq != 1 and not (isinstance(freq, list) and all(v == 1 for v in freq)):
        # NeMo builds every layer from one layer spec (get_specs with model.name ''), which routes every
        # layer whatever moe_layer_freq says; its checkpoints hold experts in every layer
        logger.warning("model.moe_layer_freq=%r is not read: every layer is a mixture of experts, as in NeMo's "
                       "layer spec (and its checkpoints)", freq)
    return kwargs


def attention_window(cfg) -> Optional[int]:
    """How many earlier positions each query sees besides its own under NeMo's ``window_size``
    (``[left, right]``, Transformer Engine's sliding window: query ``i`` attends keys ``i - left`` to
    ``i``; Mistral's .nemo files carry ``[4096, 0]``), or None for full causal attention (absent,
    null, or ``left`` -1)."""
    window = _get(cfg, "window_size")
    if window is None:
        return None
    listed = not (hasattr(window, "items") or isinstance(window, (str, bytes))) and hasattr(window, "__len__")
    values = list(window) if listed else [window]
    ok = len(values) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= -1 for v in values)
    if not ok or values[1] not in (0, -1):
        raise ConfigError(f"model.window_size={values if listed else window!r} must be [left, 0] with left >= 0 "
                          "(or -1: no window), a causal sliding window as Transformer Engine's")
    return None if values[0] == -1 else values[0]


def transformer_config_from_cfg(cfg, precision="32"):
    """A ``TransformerConfig`` from a NeMo model config (``cfg.model``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported_architecture(cfg)
    check_architecture_values(cfg)

    pos = str(_get(cfg, "position_embedding_type", "learned_absolute"))
    if pos not in _POSITION_EMBEDDINGS:
        raise ConfigError(f"model.position_embedding_type={pos!r} must be one of {sorted(_POSITION_EMBEDDINGS)}")
    norm = str(_get(cfg, "normalization", "layernorm")).lower()
    if norm not in _NORMALIZATIONS:
        raise ConfigError(f"model.normalization={norm!r} is not supported (supported: {', '.join(sorted(_NORMALIZATIONS))})")
    if zero_centered_gamma(cfg) and _NORMALIZATIONS[norm] != "LayerNorm":
        raise ConfigError(f"model.layernorm_zero_centered_gamma=True needs a LayerNorm, not model.normalization={norm!r}")
    activation_func, gated = activation_from_cfg(cfg)

    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    if hidden % heads != 0 and _get(cfg, "kv_channels") is None:
        raise ConfigError(f"model.hidden_size={hidden} is not divisible by model.num_attention_heads={heads}")
    groups = _get(cfg, "num_query_groups")
    if groups is not None and (int(groups) <= 0 or heads % int(groups) != 0):
        raise ConfigError(f"model.num_query_groups={groups} must divide model.num_attention_heads={heads} (grouped-query "
                          "attention shares each key/value head among the same number of query heads)")
    if pos == "learned_absolute":
        seq = _get(cfg, "encoder_seq_length")
        table = _get(cfg, "max_position_embeddings")
        if seq is not None and table is not None and int(table) < int(seq):
            # a batch of encoder_seq_length tokens would index past the table in the middle of a run
            raise ConfigError(f"model.max_position_embeddings={table} is shorter than model.encoder_seq_length={seq}: "
                              "learned positions end at the table; lower the sequence length")
    tp = int(_get(cfg, "tensor_model_parallel_size", 1))
    pp = int(_get(cfg, "pipeline_model_parallel_size", 1))
    sequence_parallel = sequence_parallel_on(cfg)  # NeMo's rule: none at TP=1
    if sequence_parallel and not torch.cuda.is_available():
        raise ConfigError(
            "model.sequence_parallel=True needs Transformer Engine on a GPU; set model.sequence_parallel=False on CPU"
        )
    dtype = precision_dtype(precision)
    bias = bool(_get(cfg, "bias", True))
    granularity = _get(cfg, "activations_checkpoint_granularity")
    recompute = {k: _get(cfg, k) for k in ("activations_checkpoint_granularity", "activations_checkpoint_method",
                                           "activations_checkpoint_num_layers")}
    # the config rules over a checkpoint's values too (a .nemo loaded for export or generation only)
    check_config_values(OmegaConf.create({"model": {k: v for k, v in recompute.items() if v is not None}}))
    kwargs = dict(
        num_layers=int(_get(cfg, "num_layers")),
        hidden_size=hidden,
        ffn_hidden_size=int(_get(cfg, "ffn_hidden_size", 4 * hidden)),
        num_attention_heads=heads,
        num_query_groups=_get(cfg, "num_query_groups"),
        kv_channels=_get(cfg, "kv_channels"),
        hidden_dropout=float(_get(cfg, "hidden_dropout", 0.0) or 0.0),
        attention_dropout=float(_get(cfg, "attention_dropout", 0.0) or 0.0),
        layernorm_epsilon=float(_get(cfg, "layernorm_epsilon", 1e-5)),
        normalization=_NORMALIZATIONS[norm],
        activation_func=activation_func,
        gated_linear_unit=gated,
        add_bias_linear=bias,
        add_qkv_bias=bool(_get(cfg, "qkv_bias", bias)),
        # megatron-core 0.19 checks the layer spec's q/k norms against this flag
        qk_layernorm=bool(_get(cfg, "qk_layernorm", False)),
        init_method_std=float(_get(cfg, "init_method_std", 0.02)),
        # NeMo turns it off except in fp16, where it only guards against overflow (the scores are
        # divided by the layer number and multiplied back in the softmax): the maths is the same
        apply_query_key_layer_scaling=bool(_get(cfg, "apply_query_key_layer_scaling", False)) and dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        autocast_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available() or bool(_get(cfg, "use_cpu_initialization", False)),
        perform_initialization=True,
        gradient_accumulation_fusion=False,  # MegatronGPTModel turns it on for trainable CPU models (main_grad exists)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=pp > 1,
        recompute_granularity=granularity,
        recompute_method=_get(cfg, "activations_checkpoint_method") if granularity == "full" else None,
        recompute_num_layers=_get(cfg, "activations_checkpoint_num_layers") if granularity == "full" else None,
    )
    moe = moe_config_kwargs(cfg)
    if moe:  # megatron-core's own fallback, said here without its warning in every run
        moe.setdefault("moe_ffn_hidden_size", kwargs["ffn_hidden_size"])
    kwargs.update(moe)
    try:
        return TransformerConfig(**kwargs)
    except (ValueError, AssertionError, TypeError) as err:
        if not moe:
            raise
        # megatron-core checks the MoE settings together (top-k against the experts, the router's options)
        raise ConfigError(f"model's mixture-of-experts settings ({', '.join(sorted(moe))}): {err}") from None


def uses_te_spec(cfg) -> bool:
    """Whether the model is built with Transformer Engine's layer spec (its parameter names differ)."""
    return te_available() and not bool(_get(cfg, "force_local_spec", False))


def _submodules(spec):
    """The submodules of a layer-spec entry: a ``ModuleSpec`` (megatron-core 0.16) or, for the MLP
    from 0.17 on, a ``functools.partial`` of its builder with ``submodules=`` bound."""
    if hasattr(spec, "submodules"):
        return spec.submodules
    return spec.keywords["submodules"]


def mlp_specs(mlp) -> list:
    """The dense MLPs' submodules in a layer's MLP spec: the MLP itself, or a MoE layer's experts
    and shared experts (every one of them must get the same activation module)."""
    sub = _submodules(mlp)
    if hasattr(sub, "linear_fc1"):
        return [sub]
    return [_submodules(s) for s in (getattr(sub, "experts", None), getattr(sub, "shared_experts", None))
            if s is not None]


def layer_spec(cfg, config):
    """Transformer Engine spec on a GPU with TE installed, megatron-core's local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    normalization = config.normalization
    if uses_te_spec(cfg):
        config.layernorm_zero_centered_gamma = zero_centered_gamma(cfg)
        window = attention_window(cfg)
        config.window_size = None if window is None else (window, 0)
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False,
            qk_layernorm=bool(_get(cfg, "qk_layernorm", False))
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False,
        normalization=normalization, qk_layernorm=bool(_get(cfg, "qk_layernorm", False))
    )
    from nemo_aligner.models.nlp.gpt import lean_ops
    from nemo_aligner.utils import patches

    patches.use_lean_rope(lean_ops.apply_rotary)
    if config.gated_linear_unit and config.activation_func is F.silu:
        # The MLP calls a spec-built activation module on fc1's whole output when this flag is
        # set (megatron-core's hook for Transformer Engine activations).
        config.use_te_activation_func = True
        for mlp in mlp_specs(spec.submodules.mlp):
            mlp.activation_func = lean_ops.SwiGLU
    window = attention_window(cfg)
    if bool(_get(cfg, "use_sdpa_attention", True)):
        from megatron.core.transformer.spec_utils import ModuleSpec

        from nemo_aligner.models.nlp.gpt.sdpa_attention import SDPADotProductAttention

        spec.submodules.self_attention.submodules.core_attention = \
            SDPADotProductAttention if window is None else ModuleSpec(module=SDPADotProductAttention,
                                                                      params={"window": window})
    elif window is not None:
        raise ConfigError("model.window_size (a sliding window) needs model.use_sdpa_attention=True here")
    if window is not None and config.attention_dropout:
        raise ConfigError(f"model.attention_dropout={config.attention_dropout} with model.window_size: the sliding "
                          "window is computed without attention dropout here (set it to 0, or use Transformer Engine)")
    return spec


def build_gpt_model(cfg, vocab_size: int, precision="32", pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None, config=None, model_cls=None, **extra):
    """One pipeline stage of a megatron-core ``GPTModel`` for the current rank.

    ``vocab_size`` is the padded size (see ``padded_vocab_size``), divisible by TP.
    ``model_cls`` (a ``GPTModel`` subclass such as the reward model) gets ``extra`` keywords.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = config or transformer_config_from_cfg(cfg, precision)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    max_pos = int(_get(cfg, "max_position_embeddings", _get(cfg, "encoder_seq_length")))
    model = (model_cls or GPTModel)(
        config=config,
        transformer_layer_spec=layer_spec(cfg, config),
        vocab_size=vocab_size,
        max_sequence_length=max_pos,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(_get(cfg, "share_embeddings_and_output_weights", True)),
        position_embedding_type=str(_get(cfg, "position_embedding_type", "learned_absolute")),
        rotary_percent=float(_get(cfg, "rotary_percentage", 1.0)),
        rotary_base=int(_get(cfg, "rotary_base", 10000)),
        seq_len_interpolation_factor=_get(cfg, "seq_len_interpolation_factor"),
        # NeMo's key for Llama 3.x RoPE scaling (megatron-core's rope_scaling: low/high frequency
        # factors 1 and 4 over an original context of 8192, as Llama 3.1 and 3.2)
        rope_scaling=bool(_get(cfg, "scale_positional_embedding", False)),
        rope_scaling_factor=rope_scaling_factor(cfg) if _get(cfg, "scale_positional_embedding", False) else 8.0,
        **extra,
    )
    # NeMo's apply_embedding_scaling (Gemma): the embedding's output times sqrt(hidden_size), the
    # factor rounded to the activations' dtype as NeMo's EmbeddingScalingMixin does
    model.embedding_scale = float(config.hidden_size) ** 0.5 if _get(cfg, "apply_embedding_scaling", False) else None
    if model.embedding_scale is not None and pre_process:
        model.embedding.register_forward_hook(
            lambda module, args, out: out * torch.tensor(model.embedding_scale, dtype=out.dtype))
    from nemo_aligner.models.nlp.gpt import lean_ops

    lean_ops.use_lean_norms(model)  # torch's RMSNorm only exists in the local spec
    if zero_centered_gamma(cfg) and not config.layernorm_zero_centered_gamma:
        lean_ops.use_zero_centered_layernorms(model)  # megatron-core's local spec has no layernorm1p
    return model
