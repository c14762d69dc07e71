"""LoRA adapters between NeMo's adapters-only .nemo and Hugging Face PEFT's adapter directory.

NeMo's ``variant: nemo`` adapter on ``linear_qkv`` has one ``A`` for the fused query/key/value
projection; PEFT (on Llama-shaped models) has one adapter per projection. The conversions are exact:
- NeMo -> canonical: ``A`` copied to the query, key and value adapters, ``B``'s rows split per
  projection (the fused layer's per-group ``[queries, key, value]`` order); on a gated ``linear_fc1``,
  ``A`` copied to gate and up, ``B`` halved (NeMo's ``convert_lora_nemo_to_canonical``).
- canonical -> PEFT (Llama, Mistral, Qwen2, Gemma): ``lora_unfused_kqv_adapter.q_adapter`` is
  ``self_attn.q_proj`` and so on, ``linear_in`` is ``lora_A``, ``linear_out`` ``lora_B``; GPT-2's fused
  ``attn.c_attn`` takes the ``nemo`` variant's adapter with ``B``'s rows reordered to ``[q; k; v]``.
- PEFT -> NeMo: the reverse; a projection PEFT leaves out (``target_modules=[q_proj, v_proj]``: no key
  adapter) becomes a zero adapter, and so does a layer's missing module where other layers have it,
  so the sum ``W + scale * B A`` is PEFT's everywhere. ``use_rslora``'s scale ``alpha / sqrt(r)`` is
  folded into ``B`` (NeMo scales by ``alpha / r``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from functools import cached_property
from typing import Dict, Optional, Tuple

import torch

from nemo_aligner.models.nlp.gpt import lora
from nemo_aligner.models.nlp.gpt.gpt_builder import activation_from_cfg, precision_dtype
from nemo_aligner.models.nlp.gpt.hf_interop import (_fuse_qkv, _split_qkv, check_export_target, hf_config_from_nemo,
                                                    read_json_object)
from nemo_aligner.utils.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _slot(target: str, canonical: bool = False) -> str:
    """Where a target's adapter sits in a layer (NeMo's key), from lora's names."""
    parent, _, name, _ = lora.TARGETS[target]
    return f"{parent}.adapter_layer.{lora.CANONICAL[target][0] if canonical else name}"


_KQV, _DENSE, _HTO4H, _4HTOH = (_slot(t) for t in ("attention_qkv", "attention_dense", "mlp_fc1", "mlp_fc2"))
_UNFUSED_KQV, _UNFUSED_HTO4H = _slot("attention_qkv", True), _slot("mlp_fc1", True)
# NeMo adapter (within a layer) -> Hugging Face module (within a layer), by architecture family
_LLAMA = {f"{_UNFUSED_KQV}.q_adapter": "self_attn.q_proj", f"{_UNFUSED_KQV}.k_adapter": "self_attn.k_proj",
          f"{_UNFUSED_KQV}.v_adapter": "self_attn.v_proj", _DENSE: "self_attn.o_proj",
          f"{_UNFUSED_HTO4H}.gate_adapter": "mlp.gate_proj", f"{_UNFUSED_HTO4H}.up_adapter": "mlp.up_proj",
          _4HTOH: "mlp.down_proj"}
_GPT2 = {_KQV: "attn.c_attn", _DENSE: "attn.c_proj", _HTO4H: "mlp.c_fc", _4HTOH: "mlp.c_proj"}
# The NeMo target each adapter belongs to, and the blocks a canonical adapter must have together
_TARGET = dict({_slot(t): t for t in lora.TARGETS}, **{_slot(t, True): t for t in lora.CANONICAL})
_BLOCKS = {_slot(t, True): blocks for t, (_, blocks) in lora.CANONICAL.items()}
_LAYER_KEY = re.compile(r"^model\.decoder\.layers\.(\d+)\.(.+)\.(linear_in|linear_out)\.weight$")
_HF_PREFIX = {"gpt2": "base_model.model.transformer.h.", "llama": "base_model.model.model.layers."}
_HF_KEY = re.compile(r"^base_model\.model\.(?:model\.layers|transformer\.h)\.(\d+)\.(.+)\.lora_([AB])"
                     r"(?:\.[A-Za-z0-9_-]+)?\.weight$")


class _Shapes:
    """A model config's sizes: each adapted layer's (input, output) features."""

    def __init__(self, cfg: dict, where: str):
        try:
            self.hidden, self.heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            self.layers, self.ffn = int(cfg["num_layers"]), int(cfg["ffn_hidden_size"])
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"{where}: the model config lacks a usable {err} (hidden_size, num_attention_heads, "
                              "num_layers, ffn_hidden_size)") from None
        self.groups = int(cfg.get("num_query_groups") or self.heads)
        self.channels = int(cfg.get("kv_channels") or self.hidden // self.heads)
        self.gated = activation_from_cfg(cfg)[1]
        self.cfg = cfg

    @cached_property
    def arch(self) -> str:  # read only where a Hugging Face layout is involved
        return hf_arch(self.cfg)

    def features(self, adapter: str) -> Tuple[int, int]:
        q, kv = self.heads * self.channels, self.groups * self.channels
        fc1 = self.ffn * (2 if self.gated else 1)
        return {f"{_UNFUSED_KQV}.q_adapter": (self.hidden, q), f"{_UNFUSED_KQV}.k_adapter": (self.hidden, kv),
                f"{_UNFUSED_KQV}.v_adapter": (self.hidden, kv), _KQV: (self.hidden, q + 2 * kv),
                _DENSE: (q, self.hidden), _HTO4H: (self.hidden, fc1), f"{_UNFUSED_HTO4H}.gate_adapter":
                (self.hidden, self.ffn), f"{_UNFUSED_HTO4H}.up_adapter": (self.hidden, self.ffn),
                _4HTOH: (self.ffn, self.hidden)}[adapter]


def hf_arch(cfg: dict) -> str:
    """``gpt2`` or ``llama`` (Llama's module names: Llama, Mistral, Qwen2, Gemma, Mixtral's attention)."""
    probe = dict(cfg, padded_vocab_size=cfg.get("padded_vocab_size") or 1,
                 max_position_embeddings=cfg.get("max_position_embeddings") or 1)
    arch, _ = hf_config_from_nemo(probe)
    return "gpt2" if arch == "gpt2" else "llama"


# ----------------------------------------------------------------------------- NeMo -> canonical / PEFT
def _split(key: str, what: str = "adapters") -> Tuple[int, str, str]:
    match = _LAYER_KEY.match(key)
    if match is None:
        raise CheckpointError(f"{what}: {key} is not a layer's LoRA adapter tensor")
    return int(match.group(1)), match.group(2), match.group(3)


def to_canonical(state: Dict[str, torch.Tensor], shapes: _Shapes, what: str) -> Dict[str, torch.Tensor]:
    """``variant: nemo`` adapters (whole tensors) as ``variant: canonical`` ones: the same sums."""
    out = {}
    for key, value in state.items():
        layer, adapter, half = _split(key, what)
        prefix = f"model.decoder.layers.{layer}."
        if adapter == _KQV:  # (an expert's adapters stay as they are, as in NeMo's canonical variant)
            parts = (value,) * 3 if half == "linear_in" else _split_qkv(value, shapes.heads, shapes.groups,
                                                                         shapes.channels)
            for block, part in zip(_BLOCKS[_UNFUSED_KQV], parts):
                out[f"{prefix}{_UNFUSED_KQV}.{block}.{half}.weight"] = part.clone()  # A: one copy per block
        elif adapter == _HTO4H:
            if not shapes.gated:
                raise ConfigError(f"{what}: the canonical variant splits fc1 into gate and up adapters; this model's "
                                  "activation has no gate")
            parts = (value,) * 2 if half == "linear_in" else value.chunk(2, dim=0)
            for block, part in zip(_BLOCKS[_UNFUSED_HTO4H], parts):
                out[f"{prefix}{_UNFUSED_HTO4H}.{block}.{half}.weight"] = part.clone()
        else:
            out[key] = value
    return out


def read_nemo_lora(path: str, key: str) -> Tuple[_Shapes, lora.LoraSettings, Dict[str, torch.Tensor]]:
    """``(model config's sizes, LoRA settings, whole adapter tensors)`` of an adapters-only .nemo saved at
    any TP/PP size; refusals name ``key``."""
    from omegaconf import OmegaConf

    from nemo_aligner.models.nlp.gpt.loading import read_peft_states
    from nemo_aligner.utils.nemo_file import read_model_config

    saved = read_model_config(path, key)
    what = f"{key}={path}"
    if lora.peft_scheme(saved) != "lora":
        raise CheckpointError(f"{what}: its model_config.yaml has peft.peft_scheme={lora.peft_scheme(saved)!r}, not "
                              "LoRA adapters (an adapters-only .nemo)")
    settings = lora.lora_settings(OmegaConf.merge(saved, {"sequence_parallel": False}))
    cfg = OmegaConf.to_container(saved, resolve=True)
    shapes = _Shapes(cfg, what)
    states, tp, pp = read_peft_states(path, key)
    state = lora.join_nemo_adapter_files(states, tp, pp, shapes.layers, shapes.gated, what)
    if not state:
        raise CheckpointError(f"{what}: holds no adapter tensors")
    return shapes, settings, state


def nemo_to_canonical(nemo_lora_path: str, output_path: str, precision: Optional[str] = None) -> str:
    """An adapters-only .nemo (either variant, any TP/PP) as a canonical one at TP=1, PP=1."""
    from nemo_aligner.utils.nemo_file import write_adapters_nemo

    dtype = _dtype(precision)
    shapes, settings, state = read_nemo_lora(nemo_lora_path, "--nemo_lora_path")
    if settings.variant == "nemo":
        state = to_canonical(state, shapes, f"--nemo_lora_path={nemo_lora_path}")
    cfg = shapes.cfg
    cfg["peft"].setdefault("lora_tuning", {})["variant"] = "canonical"
    cfg.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return write_adapters_nemo(output_path, cfg, _cast(state, dtype))


def _dtype(precision: Optional[str]) -> Optional[torch.dtype]:
    """``--precision``'s dtype (None: as stored), checked before any work."""
    return None if precision is None else precision_dtype(precision, "--precision")


def _cast(state: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    return state if dtype is None else {k: v.to(dtype) for k, v in state.items()}


def nemo_to_hf_peft(nemo_lora_path: str, output_dir: str, donor_config: Optional[str] = None,
                    precision: Optional[str] = None) -> str:
    """An adapters-only .nemo as a PEFT adapter directory for the Hugging Face export of its base model."""
    from safetensors.torch import save_file

    from nemo_aligner.utils.checkpoint_io import recover_replaced_dir, replace_dir_atomically

    dtype = _dtype(precision)
    check_export_target(output_dir, {ADAPTER_CONFIG, "README.md"}, key="--output_path")
    what = f"--nemo_lora_path={nemo_lora_path}"
    shapes, settings, state = read_nemo_lora(nemo_lora_path, "--nemo_lora_path")
    if shapes.arch == "gpt2":
        if settings.variant == "canonical":
            raise ConfigError(f"{what}: canonical adapters on a GPT-2-shaped model have no PEFT form (GPT-2's "
                              "c_attn is one fused layer); train with model.peft.lora_tuning.variant=nemo")
        mapping = _GPT2
        state = {k: (_gpt2_qkv_rows(v, shapes) if _KQV in k and k.endswith("linear_out.weight") else v)
                 for k, v in state.items()}
    else:
        mapping = _LLAMA
        if settings.variant == "nemo":
            state = to_canonical(state, shapes, what)
    tensors, modules, layers = {}, set(), set()
    for key, value in state.items():
        layer, adapter, half = _split(key, what)
        if ".experts." in adapter:
            raise ConfigError(f"{what}: {key} is an expert's adapter; transformers keeps a Mixtral's experts as "
                              "one fused tensor, which PEFT does not adapt as layers")
        if adapter not in mapping:
            raise ConfigError(f"{what}: {key} has no Hugging Face PEFT counterpart")
        module = mapping[adapter]
        modules.add(module)
        layers.add(layer)
        tensors[f"{_HF_PREFIX[shapes.arch]}{layer}.{module}.lora_{'A' if half == 'linear_in' else 'B'}.weight"] = value
    if settings.dropout > 0 and settings.dropout_position == "post":
        logger.warning("%s: adapter_dropout=%g is applied to the adapters' output here (dropout_position=post); "
                       "PEFT drops their input", what, settings.dropout)
    config = _peft_config(donor_config, settings, modules, layers, shapes)
    tmp = f"{output_dir.rstrip('/')}.tmp"
    recover_replaced_dir(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in _cast(tensors, dtype).items()}, os.path.join(tmp, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    replace_dir_atomically(tmp, output_dir)
    return output_dir


def _gpt2_qkv_rows(b: torch.Tensor, shapes: _Shapes) -> torch.Tensor:
    """A fused qkv ``B``'s rows from megatron-core's per-head ``[q, k, v]`` order to GPT-2's ``[q; k; v]``."""
    return torch.cat(_split_qkv(b, shapes.heads, shapes.groups, shapes.channels))


def _peft_config(donor: Optional[str], settings: lora.LoraSettings, modules: set, layers: set,
                 shapes: _Shapes) -> dict:
    config = {}
    if donor:
        config = _read_json(donor, "--hf_config")
    # PEFT matches a name against the end of each module's path: GPT-2's attn.c_proj and mlp.c_proj
    # share "c_proj", so one of them alone keeps its parent's name
    both = {"attn.c_proj", "mlp.c_proj"} <= modules
    names = sorted({m if m.endswith(".c_proj") and not both else m.split(".")[-1] for m in modules})
    selected = sorted(layers) if len(layers) < shapes.layers else None
    config.update({
        "peft_type": "LORA", "task_type": config.get("task_type") or "CAUSAL_LM", "r": settings.dim,
        "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "target_modules": names,
        "bias": "none", "fan_in_fan_out": shapes.arch == "gpt2", "use_rslora": False, "use_dora": False,
        "layers_to_transform": selected, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "modules_to_save": None, "exclude_modules": None, "target_parameters": None, "inference_mode": True,
        "init_lora_weights": True,
    })
    config.setdefault("base_model_name_or_path", None)
    return config


def _read_json(path: str, key: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path}: no such file")
    return read_json_object(path, f"{key}={path}")


# ----------------------------------------------------------------------------- PEFT -> NeMo
def _check_peft_config(config: dict, where: str) -> Tuple[int, float, float]:
    """``(r, alpha, dropout)`` of a PEFT LoRA config, or a ConfigError naming the key it cannot honour."""
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type={config.get('peft_type')!r}; only LoRA adapters (LORA) convert")
    r, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout") or 0.0
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"{where}: r={r!r} must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"{where}: lora_alpha={alpha!r} must be a positive number")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"{where}: lora_dropout={dropout!r} must be in [0, 1)")
    for flag in ("use_rslora", "use_dora", "lora_bias", "use_qalora"):
        if config.get(flag) is not None and not isinstance(config[flag], bool):
            raise ConfigError(f"{where}: {flag}={config[flag]!r} must be true or false")
    refused = {"use_dora": "DoRA's magnitude vectors", "lora_bias": "LoRA biases",
               "modules_to_save": "fully trained modules", "rank_pattern": "per-module ranks",
               "alpha_pattern": "per-module alphas", "target_parameters": "adapters on parameters",
               "layer_replication": "replicated layers", "trainable_token_indices": "trained token embeddings",
               "use_qalora": "QALoRA", "alora_invocation_tokens": "activated LoRA"}
    for name, what in refused.items():
        if config.get(name):
            raise ConfigError(f"{where}: {name}={config[name]!r} ({what}) has no NeMo LoRA form")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where}: bias={config['bias']!r} (trained biases) has no NeMo LoRA form")
    return r, float(alpha), float(dropout)


def _read_peft_weights(hf_lora_path: str) -> Dict[str, torch.Tensor]:
    safetensors = os.path.join(hf_lora_path, ADAPTER_WEIGHTS)
    binary = os.path.join(hf_lora_path, "adapter_model.bin")
    try:
        if os.path.isfile(safetensors):
            from safetensors.torch import load_file

            state = load_file(safetensors)
        elif os.path.isfile(binary):
            state = torch.load(binary, map_location="cpu", weights_only=True)
        else:
            raise CheckpointError(f"--hf_lora_path={hf_lora_path}: no {ADAPTER_WEIGHTS} or adapter_model.bin")
    except CheckpointError:
        raise
    except Exception as err:  # a torn or foreign file
        raise CheckpointError(f"--hf_lora_path={hf_lora_path}: the adapter weights cannot be read "
                              f"({type(err).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"--hf_lora_path={hf_lora_path}: the adapter weights are not a dict of tensors")
    for key, value in state.items():
        if not torch.is_tensor(value) or not value.is_floating_point() or value.dim() != 2:
            raise CheckpointError(f"--hf_lora_path={hf_lora_path}: {key} is not a matrix of floats")
        if not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"--hf_lora_path={hf_lora_path}: {key} holds a NaN or an infinity")
    return state


def hf_peft_to_nemo(hf_lora_path: str, output_path: str, nemo_config: str, precision: Optional[str] = None) -> str:
    """A PEFT adapter directory as an adapters-only .nemo for ``nemo_config``'s model (a model_config.yaml
    or the base .nemo): canonical adapters on Llama-shaped models, NeMo's fused ones on GPT-2."""
    from omegaconf import OmegaConf

    from nemo_aligner.utils.nemo_file import read_model_config, write_adapters_nemo

    dtype = _dtype(precision)
    where = os.path.join(hf_lora_path, ADAPTER_CONFIG)
    config = _read_json(where, "--hf_lora_path")
    r, alpha, dropout = _check_peft_config(config, where)
    base = None
    if nemo_config.endswith(".nemo") or os.path.isdir(nemo_config):
        base = os.path.abspath(nemo_config)
        cfg = OmegaConf.to_container(read_model_config(nemo_config, "--nemo_config"), resolve=True)
    else:
        if not os.path.isfile(nemo_config):
            raise ConfigError(f"--nemo_config={nemo_config}: no such file")
        try:
            cfg = OmegaConf.to_container(OmegaConf.load(nemo_config), resolve=True)
        except Exception as err:  # YAML's own errors
            raise ConfigError(f"--nemo_config={nemo_config}: not a YAML model config ({type(err).__name__})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"--nemo_config={nemo_config}: not a YAML mapping of model keys")
        cfg = cfg.get("model", cfg) if isinstance(cfg.get("model"), dict) else cfg
    shapes = _Shapes(cfg, f"--nemo_config={nemo_config}")
    mapping = {hf: nemo for nemo, hf in (_GPT2 if shapes.arch == "gpt2" else _LLAMA).items()}
    scale_fix = math.sqrt(r) if config.get("use_rslora") else 1.0  # PEFT: alpha / sqrt(r); NeMo: alpha / r
    found: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
    weights = _read_peft_weights(hf_lora_path)
    stored = next(iter(weights.values())).dtype if weights else torch.float32
    for key, value in weights.items():
        match = _HF_KEY.match(key)
        if match is None or match.group(2) not in mapping:
            raise CheckpointError(f"--hf_lora_path={hf_lora_path}: {key} is not a LoRA matrix of a "
                                  f"{'GPT-2' if shapes.arch == 'gpt2' else 'Llama'}-shaped layer's "
                                  f"{', '.join(sorted(mapping))}")
        layer, adapter = int(match.group(1)), mapping[match.group(2)]
        if layer >= shapes.layers:
            raise CheckpointError(f"--hf_lora_path={hf_lora_path}: {key} is for layer {layer}; the model has "
                                  f"{shapes.layers} layers")
        half = "linear_in" if match.group(3) == "A" else "linear_out"
        found.setdefault((layer, adapter), {})[half] = value.float() * (scale_fix if half == "linear_out" else 1.0)
    if not found:
        raise CheckpointError(f"--hf_lora_path={hf_lora_path}: holds no LoRA matrices")
    state = _nemo_state(found, shapes, r, hf_lora_path)
    targets = sorted({_TARGET[_parent(a)] for _, a in found}, key=list(lora.TARGETS).index)
    layers = sorted({layer for layer, _ in found})
    cfg.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, restore_from_path=base)
    cfg["peft"] = {"peft_scheme": "lora", "restore_from_path": None, "lora_tuning": {
        "variant": "nemo" if shapes.arch == "gpt2" else "canonical", "target_modules": targets, "adapter_dim": r,
        "alpha": alpha, "adapter_dropout": dropout, "dropout_position": "pre", "column_init_method": "xavier",
        "row_init_method": "zero", "layer_selection": None if len(layers) == shapes.layers else
        [n + 1 for n in layers]}}
    # the zero adapters and the rsLoRA fold were made in float32: back to the file's dtype
    return write_adapters_nemo(output_path, cfg, _cast(state, dtype or stored))


def _parent(adapter: str) -> str:
    return adapter.rsplit(".", 1)[0] if adapter.startswith((_UNFUSED_KQV, _UNFUSED_HTO4H)) else adapter


def _nemo_state(found: Dict[Tuple[int, str], Dict[str, torch.Tensor]], shapes: _Shapes, r: int,
                hf_lora_path: str) -> Dict[str, torch.Tensor]:
    """NeMo's tensors for every (selected layer, adapter) the PEFT files adapt somewhere: a missing one
    (a projection left out, a module absent from a layer) is a zero adapter."""
    layers = sorted({layer for layer, _ in found})
    adapters = set()
    for _, adapter in found:
        parent = _parent(adapter)
        adapters.update([f"{parent}.{block}" for block in _BLOCKS[parent]] if parent in _BLOCKS else [adapter])
    out = {}
    for layer in layers:
        for adapter in sorted(adapters):
            in_features, out_features = shapes.features(adapter)
            halves = found.get((layer, adapter), {})
            if halves and set(halves) != {"linear_in", "linear_out"}:
                raise CheckpointError(f"--hf_lora_path={hf_lora_path}: layer {layer}'s "
                                      f"{adapter.rsplit('.', 1)[-1]} has lora_A or lora_B but not both")
            a = halves.get("linear_in", torch.zeros(r, in_features))
            b = halves.get("linear_out", torch.zeros(out_features, r))
            for half, value, shape in (("A", a, (r, in_features)), ("B", b, (out_features, r))):
                if tuple(value.shape) != shape:
                    raise CheckpointError(f"--hf_lora_path={hf_lora_path}: layer {layer}'s lora_{half} for "
                                          f"{(_GPT2 if shapes.arch == 'gpt2' else _LLAMA)[adapter]} has "
                                          f"shape {list(value.shape)}, not {list(shape)} (r and the model config's "
                                          "sizes)")
            if adapter == _KQV and shapes.arch == "gpt2":  # GPT-2's [q; k; v] rows -> per-head [q, k, v]
                b = _fuse_qkv(*b.split([shapes.heads * shapes.channels, shapes.groups * shapes.channels,
                                        shapes.groups * shapes.channels]), shapes.heads, shapes.groups,
                              shapes.channels)
            prefix = f"model.decoder.layers.{layer}.{adapter}."
            out[prefix + "linear_in.weight"] = a.contiguous()
            out[prefix + "linear_out.weight"] = b.contiguous()
    return out
