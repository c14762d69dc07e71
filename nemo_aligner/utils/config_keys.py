"""NeMo-Aligner's config keys on this project: aliases, keys accepted but not read, unknown keys.

Every key of NeMo-Aligner's shipped configs is declared in ours (``conf/aligner_keys/<name>.yaml``
holds the ones this project has no use for), so its commands parse unchanged. At start-up:

- a renamed key and NeMo-Aligner's name are one key (``ALIASES``): setting either sets both;
- a key whose feature is absent here is refused unless it has its "off" value
  (``config_checks.REFUSED_UNLESS``);
- a key that is accepted but changes nothing here warns when the command line sets it (``UNREAD``);
- a key no part of the project reads (``++model.foo=1``, a key of a user's own config file) warns,
  naming it; a near miss of a real key (``++trainer.sft.max_step=5``) is an error with a suggestion.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Dict, Iterable, List, Optional, Set, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from nemo_aligner.utils.config_checks import (REFUSED_UNLESS, VALUE_OR_LIST, check_config_values, precision_name, shown,
                                              type_name)
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.model_config import ARCHITECTURE_KEYS, CHECKPOINT_UNLESS_SET

logger = logging.getLogger(__name__)

# (NeMo-Aligner's key, this project's key): the same setting.
ALIASES: Tuple[Tuple[str, str], ...] = (
    ("trainer.reinforce.num_rollouts_per_prompt", "model.reinforce.num_responses_per_prompt"),
    ("model.kto.preference_average_log_probs", "model.kto.average_log_probs"),
    ("inference.inference_micro_batch_size", "inference.micro_batch_size"),
)
# Keys that must equal another key (NeMo-Aligner's "do not change" copies).
MUST_EQUAL: Tuple[Tuple[str, str], ...] = (
    ("trainer.reinforce.model_gbs", "model.global_batch_size"),
    ("trainer.reinforce.model_mbs", "model.micro_batch_size"),
    ("trainer.rs.model_gbs", "model.global_batch_size"),
    ("trainer.rs.model_mbs", "model.micro_batch_size"),
)
# Accepted for NeMo-Aligner's commands, read by nothing here: path suffix -> why it changes nothing.
UNREAD: Dict[str, str] = {
    "optim.bucket_cap_mb": "megatron-core's optimizer sizes its gradient buckets itself",
    "optim.overlap_grad_sync": "gradient reduction is not overlapped with the backward pass",
    "optim.contiguous_grad_buffer": "megatron-core's DDP always keeps a contiguous gradient buffer",
    "data.index_mapping_dir": "jsonl files are read into memory; no index files are written",
    "data.dataloader_type": "batches are drawn by this project's global-batch sampler",
    "trt_llm.reshard": "TensorRT-LLM is not used",
    "trt_llm.max_input_len": "TensorRT-LLM is not used",
    "trt_llm.seed": "TensorRT-LLM is not used (generation is seeded from model.seed)",
    "trt_llm.model_type": "TensorRT-LLM is not used",
    "trt_llm.unload_engine_train": "TensorRT-LLM is not used",
    "batch_iterator.port": "use_flask opens no port (the ranks' torch.distributed store hands out the work)",
    "trt_model_dir": "TensorRT-LLM is not used",
    "rollout_batch_seq_length": "rollout batches are padded to their longest sequence",
    "peft.restore_from_ckpt.checkpoint_name": "adapters start from model.peft.restore_from_path (a .nemo)",
    "lora_tuning.position_embedding_strategy": "adapters are not tied across layers (weight_tying=False)",
    "steerlm2.forward_micro_batch_size": "read by train_steerlm2.py only (SteerLM 2.0)",
    "steerlm2.micro_batch_size": "read by train_steerlm2.py only (SteerLM 2.0)",
    "kto.log_prob_forward_micro_batch_size": "the KL and reference log-probs use model.micro_batch_size",
    "kto.sft_average_log_probs": "KTO has no SFT term (nor has NeMo-Aligner's)",
    "model.forward_micro_batch_size": "the reward model's training never runs a separate inference batch",
    "checkpoint_callback_params.model_parallel_size": "checkpoints are megatron-core distributed checkpoints, "
                                                      "readable at any TP/PP size",
    "activations_checkpoint_layers_per_pipeline": "recomputation follows activations_checkpoint_method/num_layers",
    "data.skip_warmup": "jsonl files are read into memory; there is no index to warm up",
    "data.splits_string": "each split has its own files in model.data.data_prefix",
    "hf_dataset": "jsonl files are read into memory",
    "memmap_workers": "jsonl files are read into memory",
    "min_seq_length": "samples are not filtered by length",
    "truncation_field": "an over-long prompt/answer sample loses its context first, then its answer (docs/sft.md)",
    "output_original_text": "validation reports losses only",
    "gradient_as_bucket_view": "megatron-core's DDP manages gradient buffers",
    "sync_batch_comm": "pipeline communication is megatron-core's",
    "use_flash_attention": "attention uses torch's scaled_dot_product_attention, flash kernels where the GPU has them",
    "save_nemo_on_validation_end": "the .nemo is written when training ends (save_nemo_on_train_end)",
    "trainer.enable_checkpointing": "a Lightning setting: checkpoints follow exp_manager.create_checkpoint_callback",
    "trainer.use_distributed_sampler": "a Lightning setting: batches come from this project's global-batch sampler",
    "trainer.logger": "a Lightning setting: loggers follow exp_manager.create_*_logger",
    "mcore_gpt": "every model is a megatron-core GPTModel",
    "megatron_amp_O2": "precision follows trainer.precision (bf16/16: fp32 master weights in the optimizer)",
    "dist_ckpt_load_strictness": "checkpoints load strictly: a missing or unexpected tensor is an error naming it",
    "dist_ckpt_format": "checkpoints are written in megatron-core's torch_dist format (NeMo reads it); torch_dist "
                        "and zarr checkpoints are both read",
}
# UNREAD for one config only: config name -> full key -> why it changes nothing there.
UNREAD_IN: Dict[str, Dict[str, str]] = {
    "compute_topk_logits": {
        "model.restore_from_path": "the teacher is pretrained_checkpoint.restore_from_path",
        "model.resume_from_checkpoint": "nothing trains; output_path's records already written are skipped",
        "model.answer_only_loss": "the records' loss mask covers the answers (as NeMo-Aligner's)",
    },
    "gpt_generate": {  # NeMo's megatron_gpt_eval.py keys
        "micro_batch_size": "prompts are generated batch_size at a time",
        **{key: "NeMo's Gradio web page is not available (server=True serves the REST API)"
           for key in ("share", "username", "password", "web_port", "chatbot_config")},
    },
}
# Subtrees whose contents are data, not keys (data paths, logger kwargs, a tokenizer's settings).
OPEN_SUBTREES = ("model.data.data_prefix", "exp_manager.wandb_logger_kwargs", "model.tokenizer",
                 "model.overwrite_base_config", "model.optim.sched", "hydra", "model.chat_prompt_tokens",
                 "chatbot_config")
# model.* keys read by the model builder (from a checkpoint or the run) without a shipped default.
_MODEL_KEYS_READ = ARCHITECTURE_KEYS + CHECKPOINT_UNLESS_SET + (
    "activations_checkpoint_granularity", "activations_checkpoint_method", "activations_checkpoint_num_layers",
    "force_local_spec", "use_cpu_initialization", "use_sdpa_attention", "sequence_parallel",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "init_method_std", "kv_channels",
    "offload_adam_states", "megatron_amp_O2", "mcore_gpt", "precision", "seed", "micro_batch_size",
    "global_batch_size", "transformer_engine", "hf_vocab_size", "num_special_tokens", "nemo_version",
    # mixture-of-experts training settings (the architecture's are in ARCHITECTURE_KEYS)
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps",
    "moe_token_dispatcher_type", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy", "moe_per_layer_logging", "moe_router_dtype", "moe_router_bias_update_rate",
    "moe_token_dropping", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm", "moe_permute_fusion",
    "moe_router_fusion", "moe_enable_deepep", "moe_shared_expert_overlap", "moe_layer_recompute",
    "expert_model_parallel_size", "expert_tensor_parallel_size",
)


def conf_dir() -> str:
    from nemo_aligner.utils.examples_path import examples_dir

    return examples_dir("nlp", "gpt", "conf")


def load_shipped(config_name: str, directory: Optional[str] = None) -> DictConfig:
    """This project's shipped config ``config_name`` with its defaults list applied (the subset of
    Hydra's syntax the shipped files use: other configs of the directory, ``x@_here_``, ``_self_``)."""
    directory = directory or conf_dir()
    raw = OmegaConf.load(os.path.join(directory, f"{config_name}.yaml"))
    defaults = list(raw.pop("defaults", []) or [])
    if "_self_" not in defaults:
        defaults.append("_self_")
    merged = OmegaConf.create({})
    for entry in defaults:
        name = str(entry)
        if name == "_self_":
            merged = OmegaConf.merge(merged, raw)
        else:
            merged = OmegaConf.merge(merged, load_shipped(name.split("@")[0], directory))
    return merged


def _paths(node, prefix: str = "") -> Iterable[Tuple[str, object]]:
    """``(dotted path, node)`` of every key, dict nodes included, without resolving values."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            child = node._get_node(key)
            yield path, child
            if isinstance(child, DictConfig):
                yield from _paths(child, path)


def known_paths(shipped: DictConfig) -> Set[str]:
    known = {path for path, _ in _paths(shipped)}
    known.update(f"model.{key}" for key in _MODEL_KEYS_READ)
    return known


def _suffix_match(path: str, suffixes: Iterable[str]) -> Optional[str]:
    for suffix in suffixes:
        if f".{suffix}." in f".{path}.":  # the whole path, its end, its start or a run of its parts
            return suffix
    return None


def _in_open_subtree(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in OPEN_SUBTREES)


def check_value_shapes(cfg: DictConfig, shipped: DictConfig) -> None:
    """A key whose shipped value is true/false takes true/false (or null), and one whose shipped
    value is a single number or bool takes a single value, not a list or dict: ``"abc"`` for
    ``exp_manager.create_wandb_logger`` would otherwise read as true, and a list deep in a recipe
    fails with a traceback that names no key."""
    for path, node in _paths(shipped):
        if isinstance(node, (DictConfig, ListConfig)) or node._is_missing():
            continue
        try:  # an interpolation's value (validation_ds.add_sep: ${model.data.train_ds.add_sep})
            default = OmegaConf.select(shipped, path, throw_on_missing=False) if node._is_interpolation() else node._value()
        except Exception:
            continue
        if (default is None or isinstance(default, (str, DictConfig, ListConfig))
                or path.rsplit(".", 1)[-1] in VALUE_OR_LIST):
            continue  # null and text keys take several kinds of value (precision=16 or "bf16"); dicts are subtrees
        try:
            value = OmegaConf.select(cfg, path, throw_on_missing=False)
        except Exception:  # an interpolation that does not resolve yet: checked where it is read
            continue
        if value is None:
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            raise ConfigError(f"{path}={shown(value)} must be a single value (like its default, {default!r}), "
                              f"got {type_name(value)}")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} must be true or false")


def unknown_keys(cfg: DictConfig, known: Set[str], leaves: Iterable[str] = ()) -> List[str]:
    """Leaf keys of ``cfg`` that nothing reads (outside the open subtrees). ``leaves``: keys whose
    shipped value is a single value (often null) that may also be given as a dict, such as NeMo-Aligner's
    ``n_examples_per_chunk: {train: .., validation: ..}``: what is under them is their value."""
    out = []
    leaves = set(leaves)
    for path, node in _paths(cfg):
        if isinstance(node, DictConfig) or _in_open_subtree(path) or path in known:
            continue
        parts = path.split(".")
        if any(".".join(parts[:i]) in leaves for i in range(1, len(parts))):
            continue
        if _suffix_match(path, UNREAD) or _suffix_match(path, REFUSED_UNLESS):
            continue  # accepted (refused unless off: config_checks)
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent and parent not in known:
            # inside an unknown subtree: its root is reported instead
            root = parent
            while "." in root and root.rsplit(".", 1)[0] not in known:
                root = root.rsplit(".", 1)[0]
            if root not in out:
                out.append(root)
            continue
        out.append(path)
    return out


def _edits(a: str, b: str) -> int:
    """Levenshtein distance."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def near_miss(path: str, known: Set[str]) -> Optional[str]:
    """A known key differing from ``path`` only in its last part, by a typo: at most 2 edits, and at
    most a third of the name (``lrr`` -> ``lr``, ``max_step`` -> ``max_steps``; not NeMo-Aligner's
    stale ``average_log_probs`` -> ``sft_average_log_probs``)."""
    parent, _, name = path.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
    best = min(siblings, key=lambda s: _edits(name, s), default=None)
    if best is None or best == name:
        return None
    distance = _edits(name, best)
    if distance > 2 or distance > len(name) // 3:
        return None
    return f"{parent}.{best}" if parent else best


def override_keys(overrides: Iterable[str]) -> List[str]:
    """The key of each command-line override (``++a.b=1`` -> ``a.b``)."""
    keys = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key and not key.startswith("hydra"):
            keys.append(key)
    return keys


def _is_interpolation(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node and OmegaConf.is_interpolation(node, leaf)


def resolve_aliases(cfg: DictConfig) -> None:
    """Make each alias pair hold one value: the one the user set (ours default to null)."""
    for aligner_key, our_key in ALIASES:
        ours, theirs = OmegaConf.select(cfg, our_key), OmegaConf.select(cfg, aligner_key)
        if ours is None and theirs is None:
            continue
        if isinstance(theirs, (list, ListConfig)) or isinstance(ours, (list, ListConfig)):
            raise ConfigError(f"{aligner_key}: a list of batch sizes is not supported; give one integer")
        # NeMo-Aligner's key still at its shipped interpolation (inference_micro_batch_size:
        # ${model.forward_micro_batch_size}) was not set by the user: only a set one disagrees
        theirs_set = theirs is not None and not _is_interpolation(cfg, aligner_key)
        if ours is not None and theirs_set and ours != theirs:
            logger.warning("%s=%s and %s=%s name one setting; using %s", aligner_key, theirs, our_key, ours, ours)
        value = ours if ours is not None else theirs
        with open_dict(cfg):
            for key in (aligner_key, our_key):
                if OmegaConf.select(cfg, key.rpartition(".")[0]) is not None:
                    OmegaConf.update(cfg, key, value, force_add=True)
    for key, other in MUST_EQUAL:
        value = OmegaConf.select(cfg, key)
        if value is not None and value != OmegaConf.select(cfg, other):
            raise ConfigError(f"{key}={value} must equal {other}={OmegaConf.select(cfg, other)} (NeMo-Aligner's copy "
                              f"of it); set {other} instead")


def warn_trt_llm(cfg: DictConfig) -> None:
    """``trainer.<rl>.trt_llm.enable=True`` (NeMo-Aligner's REINFORCE default): the same rollouts come
    from this project's engine; say so rather than refuse NeMo-Aligner's command."""
    for path, node in _paths(cfg):
        if path.endswith("trt_llm.enable") and not isinstance(node, DictConfig) and node._value() is True:
            logger.warning("%s=True: TensorRT-LLM is not used; rollouts run on nemo-aligner's own generation engine "
                           "(static KV cache; CUDA graphs on a GPU)", path)


def warn_model_precision(cfg: DictConfig) -> None:
    """``model.precision`` (``${trainer.precision}`` in the shipped configs) is read by nothing: warn when
    it is set to another precision than ``trainer.precision``, the one the run uses."""
    model, trainer = OmegaConf.select(cfg, "model.precision"), OmegaConf.select(cfg, "trainer.precision")
    if model is not None and trainer is not None and precision_name(model) != precision_name(trainer):
        logger.warning("model.precision=%s is not read: the run's precision is trainer.precision=%s", model, trainer)


def check_keys(cfg: DictConfig, config_name: str, overrides: Iterable[str] = (), warn: bool = True,
               shipped: Optional[DictConfig] = None, extra_keys: Iterable[str] = ()) -> None:
    """Refuse near misses of real keys; warn about keys nothing reads. ``cfg`` is the composed run config;
    ``shipped`` this project's config of the script (loaded here when not given)."""
    check_config_values(cfg)  # refused features and bad values first: they name the key to change
    optim = OmegaConf.select(cfg, "model.optim", throw_on_missing=False)
    if isinstance(optim, DictConfig):  # before the model loads: the schedule is built after it
        from nemo_aligner.utils.optim import check_schedule

        check_schedule(optim, warn=warn)
    if shipped is None:
        try:
            shipped = load_shipped(config_name)
        except (OSError, ValueError):  # no shipped config of that name (an installed copy without examples)
            return
    check_value_shapes(cfg, shipped)
    known = known_paths(shipped)
    known = known | set(extra_keys) if extra_keys else known
    unknown = unknown_keys(cfg, known, {path for path, node in _paths(shipped) if not isinstance(node, DictConfig)})
    for path in unknown:
        guess = near_miss(path, known)
        if guess:
            raise ConfigError(f"{path} is not a key of {config_name}; did you mean {guess}?")
    if not warn:
        return
    for path in unknown:
        logger.warning("%s is not read by nemo-aligner (%s.yaml has no such key); it is ignored", path, config_name)
    warn_model_precision(cfg)
    warn_trt_llm(cfg)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    for key in override_keys(overrides):
        why = next((why for name, why in UNREAD_IN.get(config_name, {}).items()
                    if key == name or key.startswith(name + ".")), None)
        suffix = None if why else _suffix_match(key, UNREAD)
        if suffix and not UNREAD[suffix].startswith(f"read by {script} "):
            why = UNREAD[suffix]
        if why:
            logger.warning("%s is accepted for NeMo-Aligner's commands but changes nothing here: %s", key, why)
