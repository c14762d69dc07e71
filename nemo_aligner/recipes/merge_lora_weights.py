"""``merge_lora_weights.py``: LoRA adapters merged into their base model, written as an ordinary .nemo
(NeMo's ``merge_lora_weights/merge.py`` keys: ``gpt_model_file``, ``lora_model_path``,
``merged_model_path``, ``trainer.precision``).

The adapters may have been trained at any TP/PP size; the merge runs at TP=1, PP=1. Each adapted
weight becomes ``W + (alpha / adapter_dim) * B A`` in float32, then the output precision, adapters on
mixture-of-experts experts included."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.models.nlp.gpt import lora
from nemo_aligner.models.nlp.gpt.loading import load_model, read_peft_states
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
from nemo_aligner.utils import distributed as D
from nemo_aligner.utils import nemo_file
from nemo_aligner.utils.config_checks import precision_name
from nemo_aligner.utils.errors import CheckpointError, ConfigError


def _path(cfg: DictConfig, key: str) -> str:
    value = cfg.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}={value!r} must be a path to a .nemo")
    return value


def run_merge_lora_weights(cfg: DictConfig) -> str:
    """Write ``merged_model_path``; returns its path."""
    adapters, out = _path(cfg, "lora_model_path"), _path(cfg, "merged_model_path")
    precision = precision_name((cfg.get("trainer") or {}).get("precision", 16))
    if precision is None:
        raise ConfigError(f"trainer.precision={cfg.trainer.precision!r} must be 16, bf16 or 32 (the merged weights' "
                          "dtype)")
    D.init_distributed()  # before any .nemo is read: the ranks trainer.devices starts share its extraction
    D.initialize_model_parallel(1, 1)
    saved = nemo_file.read_model_config(adapters, "lora_model_path")
    if lora.peft_scheme(saved) != "lora":
        raise CheckpointError(f"lora_model_path={adapters}: its model_config.yaml has peft.peft_scheme="
                              f"{lora.peft_scheme(saved)!r}, not LoRA adapters (an adapters-only .nemo)")
    base = cfg.get("gpt_model_file") or saved.get("restore_from_path")
    if not base:
        raise ConfigError(f"gpt_model_file=null and lora_model_path={adapters} names no base model "
                          "(restore_from_path): give the base .nemo as gpt_model_file")
    base = _path(OmegaConf.create({"gpt_model_file": base}), "gpt_model_file")
    if os.path.abspath(out) in (os.path.abspath(adapters), os.path.abspath(base)):
        raise ConfigError(f"merged_model_path={out} is an input of the merge; write it elsewhere")
    states, _, _ = read_peft_states(adapters, "lora_model_path")
    extra = sorted({k for state in states.values() for k in state if lora.ADAPTER_TAG not in k})
    if extra:
        raise CheckpointError(f"lora_model_path={adapters}: holds trained tensors besides the adapters ({extra[0]}, "
                              f"...: a reward model's head, say); merge those with the training script's "
                              "model.peft.merge_on_save=True")
    tuning = OmegaConf.to_container(saved.peft.get("lora_tuning") or {}, resolve=True)
    run_cfg = OmegaConf.create({"micro_batch_size": 1, "tensor_model_parallel_size": 1,
                                "pipeline_model_parallel_size": 1,
                                "peft": {"peft_scheme": "lora", "restore_from_path": adapters, "merge_on_save": True,
                                         "lora_tuning": tuning}})
    model = load_model(MegatronGPTModel, run_cfg, precision, base, key="gpt_model_file", trainable=False)
    path = nemo_file.save_nemo(model, out)
    if D.is_global_rank_zero():
        print(f"merged model written to {path} ({len(list(lora.adapters(model.module)))} adapters merged into "
              f"{base})", flush=True)
    return path
