"""The engine every GPT role builds on: one pipeline stage of a megatron-core GPT, its DDP
wrapper, optimizer and LR schedule, and the micro-batched forward/backward."""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable, Dict, List, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from nemo_aligner.models.nlp.gpt import expert_lockstep, lora
from nemo_aligner.models.nlp.gpt.gpt_builder import (
    build_gpt_model,
    padded_vocab_size,
    precision_dtype,
    transformer_config_from_cfg,
    uses_te_spec,
)
from nemo_aligner.utils import cpu_gemm
from nemo_aligner.utils.distributed import broadcast_from_last_stage, host_all_reduce
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.model_config import sequence_parallel_on
from nemo_aligner.utils.optim import OptimizerOffload, build_optimizer, build_scheduler, uses_distributed_optimizer

logger = logging.getLogger(__name__)

LossFn = Callable[[Dict[str, torch.Tensor], torch.Tensor], tuple]


def split_micro_batches(batch: Dict[str, torch.Tensor], micro_batch_size: int) -> List[Dict[str, torch.Tensor]]:
    """Split every tensor of ``batch`` along dim 0 into micro-batches of ``micro_batch_size``."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    size = next(iter(tensors.values())).shape[0]
    if size % micro_batch_size != 0:
        raise ConfigError(
            f"batch of {size} samples on this data-parallel rank is not a multiple of "
            f"model.micro_batch_size={micro_batch_size}"
        )
    return [
        {k: v[i : i + micro_batch_size] for k, v in tensors.items()} for i in range(0, size, micro_batch_size)
    ]


_LOCAL_EXPERTS = "mlp.experts.local_experts."  # a MoE layer's experts, numbered on this rank


class MegatronGPTModel:
    """A megatron-core ``GPTModel`` stage with DDP, optimizer and scheduler, built from ``cfg`` (``model.*``)."""

    # Roles whose sequence-parallel path is known to be wrong (reward heads on scattered hidden
    # states, decoding one token at a time) refuse model.sequence_parallel=True.
    supports_sequence_parallel = True
    # Parameters (name tags) a LoRA run trains beside the adapters: a role's own new layers (heads).
    lora_trainable: tuple = ()

    def __init__(self, cfg: DictConfig, tokenizer, precision="32", trainable: bool = True):
        from megatron.core import parallel_state

        if sequence_parallel_on(cfg) and not self.supports_sequence_parallel:
            raise ConfigError(f"model.sequence_parallel=True is not supported by {type(self).__name__} yet; "
                              "set it to False")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.precision = precision
        self.dtype = precision_dtype(precision)
        self.trainable = trainable
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        ep = parallel_state.get_expert_model_parallel_world_size()
        with open_dict(cfg):
            cfg.tensor_model_parallel_size = tp
            cfg.pipeline_model_parallel_size = pp
            if ep > 1 or cfg.get("expert_model_parallel_size") is not None:
                cfg.expert_model_parallel_size = ep
            if cfg.get("padded_vocab_size") is None:
                cfg.padded_vocab_size = padded_vocab_size(
                    tokenizer.vocab_size, cfg.get("make_vocab_size_divisible_by", 128), tp
                )
        self.transformer_config = transformer_config_from_cfg(cfg, precision)  # checks the architecture values
        if cfg.padded_vocab_size % tp != 0:
            raise ConfigError(
                f"model.padded_vocab_size={cfg.padded_vocab_size} (from the checkpoint) is not divisible by "
                f"model.tensor_model_parallel_size={tp}"
            )
        if cfg.padded_vocab_size < tokenizer.vocab_size:
            raise ConfigError(
                f"model.padded_vocab_size={cfg.padded_vocab_size} is smaller than the tokenizer's "
                f"vocabulary ({tokenizer.vocab_size})"
            )
        if trainable and not torch.cuda.is_available():
            # Weight gradients accumulate straight into DDP's main_grad buffers (one GEMM with
            # beta=1; cpu_compat provides megatron-core's fused kernel on the CPU).
            self.transformer_config.gradient_accumulation_fusion = True
        module = self.build_module()
        self.lora = lora.lora_settings(cfg)
        if self.lora is not None:
            count = lora.add_lora_adapters(module, self.lora, seed=int(cfg.get("seed", 1234) or 1234),
                                           gated=self.transformer_config.gated_linear_unit)
            sizes = lora.freeze_all_but(module, ("adapter_layer",) + tuple(self.lora_trainable))
            logger.info("LoRA: %d adapters (dim %d, scale %g) on %s; %d parameters train, %d are frozen (this rank)",
                        count, self.lora.dim, self.lora.scale, ", ".join(self.lora.targets), sizes["trainable"],
                        sizes["frozen"])
        if torch.cuda.is_available():
            # megatron-core creates its parallel linears on the GPU but norms, heads and other plain
            # torch modules on the CPU: move the whole stage (as Megatron-LM's get_model does).
            module.cuda(torch.cuda.current_device())
        if self.dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            module = Float16Module(self.transformer_config, module)
            self.restore_fp32_parts(module.module)
        self.model = [self._wrap_ddp(module) if trainable else module]
        self.optimizer = None
        self.scheduler = None

    # ----------------------------------------------------------------- building
    def build_module(self) -> torch.nn.Module:
        """This rank's pipeline stage; subclasses add heads."""
        return build_gpt_model(
            self.cfg, vocab_size=self.cfg.padded_vocab_size, precision=self.precision,
            config=self.transformer_config,
        )

    def restore_fp32_parts(self, module: torch.nn.Module) -> None:
        """Cast back to float32 the parts that must stay there after the bf16/fp16 cast (heads)."""

    def _wrap_ddp(self, module):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.dtype != torch.float32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=uses_distributed_optimizer(self.cfg.get("optim", {}) or {}),
            check_for_nan_in_grad=False,
            bucket_size=None,
        )
        ddp = DistributedDataParallel(self.transformer_config, ddp_config, module)
        # Without this the pipeline schedules never all-reduce DP gradients.
        self.transformer_config.finalize_model_grads_func = finalize_model_grads
        self.transformer_config.no_sync_func = ddp.no_sync
        return ddp

    def setup_optimization(self, max_steps: int, clip_grad: float = 1.0):
        """Build the optimizer and LR scheduler (``model.optim``); returns both."""
        if not self.trainable:
            raise RuntimeError("setup_optimization on a model built with trainable=False")
        optim_cfg = self.cfg.get("optim")
        if optim_cfg is None:
            raise ConfigError("model.optim is required for training")
        self.optimizer = build_optimizer(optim_cfg, self.model, self.dtype, clip_grad)
        self.optimizer_offload = OptimizerOffload(self.optimizer, self.module.parameters())
        self.scheduler = build_scheduler(self.optimizer, optim_cfg, max_steps)
        # fp16 loss scaling is applied inside the schedules through this hook.
        self.transformer_config.grad_scale_func = self.optimizer.scale_loss
        return self.optimizer, self.scheduler

    # ----------------------------------------------------------------- access
    @property
    def module(self) -> torch.nn.Module:
        """The bare megatron-core module of this stage (no DDP / Float16 wrappers)."""
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model[0])

    @property
    def device(self) -> torch.device:
        """Where this stage's parameters live (its GPU, or the CPU): micro-batches are moved there."""
        return next(self.module.parameters()).device

    @property
    def vocab_size(self) -> int:
        """Real vocabulary size (padding rows excluded)."""
        return self.tokenizer.vocab_size

    def parameters(self):
        return self.module.parameters()

    def num_parameters(self) -> int:
        """Parameters of the whole model, each counted once (collective over the model-parallel group)."""
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        first_stage = parallel_state.is_pipeline_first_stage()
        local = 0
        for p in self.module.parameters():
            if getattr(p, "shared", False) and not first_stage:
                continue  # tied output layer on the last stage: a copy of the embedding
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                local += p.numel()
        total = host_all_reduce(torch.tensor([local], dtype=torch.long), group=parallel_state.get_model_parallel_group())
        return int(total.item())

    def train(self):
        for m in self.model:
            m.train()

    def eval(self):
        for m in self.model:
            m.eval()

    def zero_grad(self):
        for m in self.model:
            if hasattr(m, "zero_grad_buffer"):
                m.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    # ----------------------------------------------------------------- compute
    def gpt_forward(self, model, micro_batch: Dict[str, torch.Tensor], labels: Optional[torch.Tensor] = None):
        """One stage's forward: per-token loss when ``labels`` is given (last stage), else logits."""
        return model(
            micro_batch["tokens"],
            micro_batch["position_ids"],
            micro_batch.get("attention_mask"),
            labels=labels,
        )

    def forward_backward(
        self,
        batch: Union[Dict[str, torch.Tensor], List[Dict[str, torch.Tensor]]],
        loss_fn: Optional[LossFn],
        forward_only: bool,
        micro_batch_size: int,
        forward_fn: Optional[Callable] = None,
        seq_length: Optional[int] = None,
        sequences_per_micro_batch: Optional[int] = None,
    ) -> List:
        """Run megatron-core's pipeline schedule over ``batch`` split into micro-batches (or over
        ``batch`` itself when it is a list of micro-batches).

        ``forward_fn(model, micro_batch)`` returns this stage's output (default: per-token
        loss against ``labels``). ``loss_fn(micro_batch, output)`` returns ``(loss,
        metrics)`` on the last stage; the schedule divides ``loss`` by the number of
        micro-batches. Returns the per-micro-batch metrics (last stage only) or, with
        ``loss_fn=None``, the outputs themselves. ``seq_length`` and
        ``sequences_per_micro_batch`` give the activation shape passed between pipeline
        stages when it differs from the batch's (e.g. chosen and rejected stacked).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro_batches = batch if isinstance(batch, list) else split_micro_batches(batch, micro_batch_size)
        expert_lockstep.drain(self.module, len(micro_batches))  # expert-parallel ranks done generating
        forward_fn = forward_fn or (lambda model, mb: self.gpt_forward(model, mb, labels=mb.get("labels")))
        device = self.device

        def forward_step(data_iterator, model):
            # Batches are built on the host; each micro-batch moves to the model's device here
            # (a no-op on the CPU), so forward and loss functions see one device.
            mb = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                  for k, v in next(data_iterator).items()}
            output = forward_fn(model, mb)
            if loss_fn is None:
                return output, lambda out, non_loss_data=False: out
            return output, partial(loss_fn, mb)

        if seq_length is None:
            seq_length = micro_batches[0]["tokens"].shape[1]
        with cpu_gemm.weights_unchanged():  # the weights change only between schedules
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=self.model,
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=sequences_per_micro_batch or micro_batch_size,
                forward_only=forward_only,
                collect_non_loss_data=loss_fn is None,
            )

    def reduce_metrics(self, outputs: List[Dict[str, torch.Tensor]], sum_keys=(), mean_keys=(),
                       token_mean_keys=()) -> Dict[str, float]:
        """Metrics of one global batch, identical on every rank.

        ``outputs`` are the per-micro-batch dicts the schedule returns on the last pipeline
        stage. ``sum_keys`` are summed over micro-batches and data-parallel ranks;
        ``mean_keys`` are averaged over both (each micro-batch weighs the same);
        ``token_mean_keys`` (per-token means of a micro-batch) are weighted by its ``tokens``, so a
        micro-batch with no trained token (its mean a placeholder 0) does not count.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state

        weighted = [k for k in token_mean_keys if k not in sum_keys and k not in mean_keys]
        keys = list(sum_keys) + list(mean_keys) + weighted + (["tokens"] if weighted and "tokens" not in sum_keys else [])
        stats = torch.zeros(len(keys), dtype=torch.float64)
        group = parallel_state.get_data_parallel_group()
        dp = dist.get_world_size(group)
        if parallel_state.is_pipeline_last_stage() and outputs and keys:
            per_key = []
            stacked = {key: torch.stack([o[key].detach().double().reshape(()).cpu() for o in outputs]) for key in keys}
            tokens = stacked["tokens"] if weighted else None  # "tokens" is among the keys whenever weighted
            for key in keys:
                values = stacked[key]
                if key in weighted:
                    per_key.append((values * tokens).sum())  # divided by all ranks' tokens below
                elif key in sum_keys or key == "tokens":
                    per_key.append(values.sum())
                else:
                    per_key.append(values.mean() / dp)
            stats = torch.stack(per_key)  # metrics may come from either device
        stats = host_all_reduce(broadcast_from_last_stage(stats), group=group)
        result = dict(zip(keys, stats.tolist()))
        for key in weighted:
            result[key] = result[key] / result["tokens"] if result["tokens"] > 0 else 0.0
        if weighted and "tokens" not in sum_keys:
            del result["tokens"]
        return result

    # Step hooks of SupervisedInterface: train mode with fresh gradients, eval mode to validate.
    def prepare_for_training_step(self) -> None:
        self.train()
        self.zero_grad()

    def prepare_for_validation_step(self) -> None:
        self.eval()

    def finish_validation_step(self) -> None:
        self.train()

    def grads_are_finite(self) -> bool:
        """Whether every gradient on every rank is finite (collective over the world)."""
        import torch.distributed as dist

        grads = []
        for p in self.module.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(g)
        finite = torch.ones(1)
        if grads:
            finite[0] = float(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())
        if dist.is_initialized() and dist.get_world_size() > 1:
            finite = host_all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    # ----------------------------------------------------------------- checkpoints
    def sharded_state_dict(self, prefix: str = "model.", adapters: bool = True) -> dict:
        """megatron-core sharded state dict with NeMo's key names (``model.decoder.layers...``);
        ``adapters=False`` leaves LoRA adapters out."""
        sharded = self.module.sharded_state_dict(prefix=prefix)
        if not adapters:
            sharded = {k: v for k, v in sharded.items() if lora.ADAPTER_TAG not in k}
        return sharded

    def trainable_names(self) -> Optional[set]:
        """State-dict names of the parameters this run trains; None: all of them (no LoRA)."""
        if self.lora is None:
            return None
        return {name for name, p in self.module.named_parameters() if p.requires_grad}

    def checkpoint_state_dict(self) -> dict:
        """What a training checkpoint holds of the model: every weight, or with LoRA only the trained ones
        (adapters, heads); the frozen base comes from ``model.restore_from_path`` on resume."""
        sharded = self.sharded_state_dict()
        names = self.trainable_names()
        if names is not None:
            sharded = {k: v for k, v in sharded.items() if k[len("model."):] in names}
        return sharded

    def nemo_export(self) -> str:
        """What ``save_nemo`` writes: ``full`` weights, LoRA ``adapters`` only (NeMo's PEFT layout), or the
        adapters ``merged`` into the base weights (``model.peft.merge_on_save``)."""
        if self.lora is None:
            return "full"
        return "merged" if bool((self.cfg.get("peft") or {}).get("merge_on_save", False)) else "adapters"

    def merged_for_export(self):
        """Context in which the weights are the LoRA-merged ones (the base model's otherwise)."""
        from contextlib import nullcontext

        return lora.merged_into_base(self.module) if self.lora is not None else nullcontext()

    def nemo_adapter_state(self) -> Dict[str, torch.Tensor]:
        """This rank's adapters (and trained heads) as NeMo's PEFT checkpoint stores them."""
        return lora.nemo_adapter_state(self.module, tuple(self.lora_trainable))

    def cpu_weights_copy(self) -> Dict[str, torch.Tensor]:
        """A CPU copy of the weights to swap back in later (a reference policy, the critic's reward model):
        with LoRA only the trained tensors, since the frozen base never changes."""
        from nemo_aligner.utils.weight_swap import cpu_state_copy

        names = self.trainable_names()
        copy = cpu_state_copy(self.module, names)
        if names is not None:
            full = sum(v.numel() * v.element_size() for v in self.module.state_dict().values() if torch.is_tensor(v))
            kept = sum(v.numel() * v.element_size() for v in copy.values())
            logger.info("LoRA: weight copy holds %.2f MB (the trained tensors) instead of %.2f MB (this rank)",
                        kept / 2**20, full / 2**20)
        return copy

    def model_config_dict(self) -> dict:
        """The model config saved into checkpoints."""
        cfg = OmegaConf.to_container(self.cfg, resolve=True)
        cfg["mcore_gpt"] = True
        # NeMo builds Transformer Engine's spec only with this key True (absent: megatron-core's local
        # spec). Both read the stored norm names; TE's also expects its per-layer extra state, which only
        # a TE-built model writes.
        cfg["transformer_engine"] = uses_te_spec(self.cfg)
        cfg["precision"] = self.precision
        cfg["tokenizer"] = self.tokenizer.config()
        return cfg

    def load_weights(self, directory: str, what: str = "checkpoint", allow_missing=()) -> list:
        """Load this stage's weights from a torch_dist directory (any TP/PP layout); returns keys left new."""
        from nemo_aligner.utils.checkpoint_io import load_sharded

        if self.lora is not None:
            allow_missing = tuple(allow_missing) + ("adapter_layer",)  # a base model has no adapters
        loaded, missing = load_sharded(self.sharded_state_dict(), directory, allow_missing=allow_missing, what=what)
        state = {k[len("model."):]: v for k, v in loaded.items() if k.startswith("model.")}
        result = self.module.load_state_dict(state, strict=False)
        # Only tensors the checkpoint was allowed to lack, and TE's per-layer extra state, may stay unset.
        unexpected = [k for k in result.missing_keys if not k.endswith("_extra_state")
                      and not any(tag in k for tag in allow_missing)]
        if unexpected:
            from nemo_aligner.utils.errors import CheckpointError

            raise CheckpointError(f"{what} {directory}: no values for {unexpected[:3]} ({len(unexpected)} tensors)")
        return missing

    def load_full_state_dict(self, full: Dict[str, torch.Tensor], what: str = "checkpoint", allow_missing=()) -> list:
        """Load this stage's share of a whole-model state dict (megatron-core local-spec names, global
        per-layer numbers, unsharded tensors: what the legacy and zarr readers return); returns the
        keys left new (``allow_missing``)."""
        from megatron.core import parallel_state

        from nemo_aligner.utils.errors import CheckpointError
        from nemo_aligner.utils.legacy_checkpoint import TE_NORM_ALIASES

        if self.lora is not None:
            allow_missing = tuple(allow_missing) + ("adapter_layer",)
        te_to_local = {te: local for local, te in TE_NORM_ALIASES.items()}
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        module = self.module
        layer_numbers = {}
        if getattr(module, "decoder", None) is not None:
            layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(module.decoder.layers)}
        # expert parallelism: this rank's local experts are the global ones from ep_rank x local count
        ep_offset = parallel_state.get_expert_model_parallel_rank() * (
            (self.transformer_config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size())
        state, new = {}, []
        for name, param in module.named_parameters():
            key = name
            if name.startswith("decoder.layers."):
                _, _, index, rest = name.split(".", 3)
                if rest.startswith(_LOCAL_EXPERTS) and ep_offset:
                    expert, tail = rest[len(_LOCAL_EXPERTS):].split(".", 1)
                    rest = f"{_LOCAL_EXPERTS}{int(expert) + ep_offset}.{tail}"
                key = f"decoder.layers.{layer_numbers[int(index)]}.{te_to_local.get(rest, rest)}"
            if key == "output_layer.weight" and key not in full and \
                    (getattr(param, "shared", False) or self.cfg.get("share_embeddings_and_output_weights", True)):
                key = "embedding.word_embeddings.weight"  # tied: the last stage's copy of the embedding
            if key not in full:
                if any(tag in key for tag in allow_missing):
                    new.append(key)
                    continue
                raise CheckpointError(f"{what}: tensor {key!r} is missing from the checkpoint; it was saved from a "
                                      "different model")
            tensor = full[key]
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                dim = param.partition_dim
                # a dense MLP's fc1 or an expert's (mlp.experts.local_experts.N.linear_fc1)
                if self.transformer_config.gated_linear_unit and ".mlp." in key and \
                        key.endswith(("linear_fc1.weight", "linear_fc1.bias")):
                    gate, up = tensor.chunk(2, dim=0)
                    tensor = torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
                else:
                    tensor = tensor.chunk(tp, dim=dim)[tp_rank]
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(f"{what}: tensor {key!r} has shape {list(tensor.shape)} for this rank but "
                                      f"{list(param.shape)} in the model built from the config; the model.* "
                                      "architecture keys do not match this checkpoint")
            state[name] = tensor
        result = module.load_state_dict(state, strict=False)
        unexpected = [k for k in result.missing_keys if not k.endswith("_extra_state") and k in state]
        if unexpected:
            raise CheckpointError(f"{what}: no values for {unexpected[:3]} ({len(unexpected)} tensors)")
        return new
