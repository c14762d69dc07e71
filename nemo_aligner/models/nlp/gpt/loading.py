"""Build a GPT role model from a run config, restoring weights from a .nemo when one is given."""

from __future__ import annotations

import logging
import os
from typing import Optional, Type

from omegaconf import DictConfig, open_dict

from nemo_aligner.models.nlp.gpt import lora
from nemo_aligner.utils import nemo_file
from nemo_aligner.utils.errors import CheckpointError
from nemo_aligner.utils.model_config import merge_checkpoint_config
from nemo_aligner.utils.tokenizers import build_tokenizer

logger = logging.getLogger(__name__)

class CheckpointWeights:
    """The weights of an extracted .nemo, whichever format NeMo wrote them in: a torch_dist or zarr
    distributed checkpoint in ``model_weights/``, or legacy ``model_weights.ckpt`` files."""

    def __init__(self, nemo_dir: str, model_cfg: DictConfig, what: str):
        from nemo_aligner.utils.checkpoint_io import is_sharded_checkpoint
        from nemo_aligner.utils.errors import CheckpointError
        from nemo_aligner.utils.legacy_checkpoint import legacy_weight_files
        from nemo_aligner.utils.zarr_checkpoint import is_zarr_checkpoint

        self.what, self.cfg, self.nemo_dir = what, model_cfg, nemo_dir
        self.directory = nemo_file.weights_dir(nemo_dir)
        self._full = None
        if is_sharded_checkpoint(self.directory):
            self.kind = "zarr" if is_zarr_checkpoint(self.directory) else "torch_dist"
        elif legacy_weight_files(nemo_dir):
            self.kind = "legacy"
        else:
            raise CheckpointError(f"{what}: holds neither model_weights/ (a distributed checkpoint) nor "
                                  "model_weights.ckpt (NeMo's earlier format)")

    def full_state(self) -> dict:
        """The whole model's tensors (legacy and zarr formats), read once."""
        if self._full is None:
            from nemo_aligner.models.nlp.gpt.gpt_builder import activation_from_cfg
            from nemo_aligner.utils.legacy_checkpoint import read_legacy_weights
            from nemo_aligner.utils.zarr_checkpoint import read_zarr_weights

            if self.kind == "legacy":
                self._full = read_legacy_weights(self.nemo_dir, gated=activation_from_cfg(self.cfg)[1])
            else:
                self._full = read_zarr_weights(self.directory, int(self.cfg.num_layers))
        return self._full

    def vocab_rows(self):
        """Rows of the stored embedding (or output layer), None if the checkpoint has neither."""
        if self.kind == "torch_dist":
            from nemo_aligner.utils.checkpoint_io import checkpoint_shapes

            shapes = checkpoint_shapes(self.directory, self.what)
            shape = shapes.get("model.embedding.word_embeddings.weight") or shapes.get("model.output_layer.weight")
            return None if shape is None else int(shape[0])
        from nemo_aligner.utils.legacy_checkpoint import vocab_rows

        return vocab_rows(self.full_state())

    def load_into(self, model, allow_missing=()) -> list:
        if self.kind == "torch_dist":
            return model.load_weights(self.directory, what=self.what, allow_missing=allow_missing)
        logger.info("%s: reading %s weights", self.what, "legacy model_weights.ckpt" if self.kind == "legacy" else "zarr")
        return model.load_full_state_dict(self.full_state(), what=self.what, allow_missing=allow_missing)


def load_model(model_cls: Type, cfg: DictConfig, precision, restore_path: Optional[str] = None,
               key: str = "model.restore_from_path", allow_missing=(), keep_new=(), **kwargs):
    """``model_cls(cfg, tokenizer, precision, **kwargs)``, with weights from ``restore_path`` if set.
    Parameters whose names contain a tag of ``keep_new`` keep their fresh initialisation even when the
    checkpoint has them (NeMo-Aligner's ``load_rm_head_weights=False``).

    Without ``restore_path`` the model is randomly initialised from ``cfg`` and uses
    the tokenizer in ``cfg.tokenizer`` (the built-in byte tokenizer by default).
    Returns the model; the effective config is ``model.cfg``.
    """
    if not restore_path:
        tokenizer = build_tokenizer(cfg.get("tokenizer"))
        return load_peft_adapters(model_cls(cfg, tokenizer, precision, **kwargs))
    ckpt_cfg = nemo_file.read_model_config(restore_path, key)
    merged = merge_checkpoint_config(ckpt_cfg, cfg)
    what = f"{key}={restore_path}"
    with nemo_file.extracted(restore_path, key) as directory:
        if lora.peft_scheme(ckpt_cfg) == "lora" and not os.path.isdir(os.path.join(directory, nemo_file.MODEL_WEIGHTS)):
            raise CheckpointError(f"{what}: holds LoRA adapters only (NeMo's PEFT layout); give it as "
                                  f"model.peft.restore_from_path (with model.peft.peft_scheme=lora and its lora_tuning "
                                  f"settings), with the base model as {key}, or merge it into its base with "
                                  "examples/nlp/gpt/merge_lora_weights.py")
        weights = CheckpointWeights(directory, merged, what)
        if merged.get("padded_vocab_size") is None and weights.vocab_rows() is not None:
            with open_dict(merged):  # NeMo pads with the TP size it trained with: the stored rows decide
                merged.padded_vocab_size = weights.vocab_rows()
        tokenizer, tokenizer_cfg = nemo_file.restored_tokenizer(merged, directory, what)
        with open_dict(merged):
            merged.tokenizer = tokenizer_cfg
        model = model_cls(merged, tokenizer, precision, **kwargs)
        fresh = {name: p.detach().clone() for name, p in model.module.named_parameters()
                 if any(tag in name for tag in keep_new)}
        weights.load_into(model, tuple(allow_missing) + tuple(keep_new))
        from nemo_aligner.utils.checkpoint_io import non_finite_tensor

        bad = non_finite_tensor(model.module)
        if bad is not None:
            raise CheckpointError(f"{key}={restore_path}: tensor {bad!r} holds a NaN or an infinity; the "
                                  "checkpoint is damaged or was saved from a diverged run")
        if fresh:
            import torch

            with torch.no_grad():
                for name, p in model.module.named_parameters():
                    if name in fresh:
                        p.copy_(fresh[name])
            logger.info("kept new %s (not loaded from the checkpoint)", ", ".join(sorted(keep_new)))
    logger.info("restored weights from %s", restore_path)
    return load_peft_adapters(model)


def load_peft_adapters(model, key: str = "model.peft.restore_from_path"):
    """Set a LoRA model's adapters from ``model.peft.restore_from_path`` (an adapters-only .nemo in
    NeMo's PEFT layout, saved at any TP/PP size) when it is given; returns the model."""
    path = (model.cfg.get("peft") or {}).get("restore_from_path")
    if not path:
        return model
    if getattr(model, "lora", None) is None:
        raise CheckpointError(f"{key}={path} is set but model.peft.peft_scheme is none: set "
                              "model.peft.peft_scheme=lora (and the adapters' model.peft.lora_tuning settings)")
    states, tp, pp = read_peft_states(path, key)
    count = lora.load_nemo_adapters(model.module, states, tp, pp, int(model.cfg.num_layers), f"{key}={path}")
    logger.info("LoRA: %d adapter tensors restored from %s", count, path)
    return model


def read_peft_states(path: str, key: str):
    """``({(tp_rank, pp_rank): {name: tensor}}, tp, pp)``: the per-rank tensors of the adapters-only .nemo
    ``path`` (NeMo's PEFT layout) and the model-parallel sizes it was saved at, each file checked to be a
    dict of named, finite floating-point tensors; a damaged one is a ``CheckpointError`` naming ``key``."""
    import torch

    saved = nemo_file.read_model_config(path, key)
    what = f"{key}={path}"
    sizes = []
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = saved.get(name, 1)
        value = 1 if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise CheckpointError(f"{what}: model_config.yaml {name}={value!r} is not a model-parallel size (the "
                                  "adapter files' layout)")
        sizes.append(value)
    tp, pp = sizes
    states = {}
    with nemo_file.extracted(path, key) as directory:
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                name = nemo_file.peft_weights_file(tp, pp, tp_rank, pp_rank)
                file = os.path.join(directory, name)
                if not os.path.isfile(file):
                    raise CheckpointError(f"{what}: has no {name}; not an adapters-only .nemo (NeMo's PEFT layout) "
                                          f"saved at tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}")
                try:
                    state = torch.load(file, map_location="cpu", weights_only=True)
                except Exception as err:  # a torn or foreign file
                    raise CheckpointError(f"{what}: {name} cannot be read ({type(err).__name__})") from None
                if not isinstance(state, dict):
                    raise CheckpointError(f"{what}: {name} holds a {type(state).__name__}, not a dict of adapter "
                                          "tensors (NeMo's PEFT layout)")
                for k, v in state.items():
                    floating = torch.is_tensor(v) and (v.is_floating_point() or v.numel() == 0)
                    if not isinstance(k, str) or not floating:
                        raise CheckpointError(f"{what}: {name} entry {k!r} is a {type(v).__name__}"
                                              f"{' of ' + str(v.dtype) if torch.is_tensor(v) else ''}, not a "
                                              "floating-point tensor")
                    if not bool(torch.isfinite(v).all()):
                        raise CheckpointError(f"{what}: {name} entry {k!r} holds a NaN or an infinity; the adapters "
                                              "are damaged or were saved from a diverged run")
                states[(tp_rank, pp_rank)] = state
    return states, tp, pp
