"""Every change this package makes to torch's, megatron-core's or another library's behaviour, one
module per concern, applied from here only:

- :func:`apply_at_import` (from ``import nemo_aligner``, before megatron-core is imported):
  ``deferred_compile``, megatron-core's import-time ``torch.compile`` decorators compile on first call
  and its import of ``wandb`` waits until wandb is used.
- :func:`apply` (before the first model is built, ``distributed.initialize_model_parallel``):
  ``cpu_compat`` (megatron-core on a machine without CUDA), ``checkpoint_results`` (synchronous
  checkpoint writes report through an in-process queue), ``moe_without_te`` (megatron-core's MoE
  router where Transformer Engine is absent), ``moe_equal_tokens`` (MoE layers with experts split
  over ranks that hold different numbers of tokens), ``stop_signal_dumps`` (no stack dump on
  SIGINT/SIGTERM from megatron-core's inference coordinator, which the CPU patches import).
- :func:`use_lean_rope` (by the GPT builder, which owns the replacement): ``rope``.
- :func:`use_sentencepiece_schema` (before transformers reads a sentencepiece model):
  ``sentencepiece_schema``, the model file's protobuf schema where sentencepiece's own module
  refuses the installed protobuf.
- ``rendezvous_store``: torch's rendezvous store listening on its host only (used by the launch
  code around the calls it covers).
- ``optimizer_state``: megatron-core's optimizers (plain and distributed) made able to save and load float32 parameters of a
  bf16 model and a chained optimizer with a parameter-less part (used by the checkpoint code around
  its ``sharded_state_dict`` calls).
"""

from __future__ import annotations

from typing import Callable


def apply_at_import() -> None:
    from nemo_aligner.utils.patches import deferred_compile

    deferred_compile.install()


def apply() -> bool:
    """Start-up patches; returns whether the CPU patches were applied (no CUDA here)."""
    from nemo_aligner.utils.patches.checkpoint_results import use_in_process_results_queue
    from nemo_aligner.utils.patches import moe_equal_tokens, moe_without_te, stop_signal_dumps
    from nemo_aligner.utils.patches.cpu_compat import apply_cpu_patches

    use_in_process_results_queue()
    moe_without_te.install()
    moe_equal_tokens.install()
    applied = apply_cpu_patches()
    stop_signal_dumps.install()  # after the imports above: the CPU patches import the inference engines
    return applied


def use_sentencepiece_schema() -> None:
    from nemo_aligner.utils.patches import sentencepiece_schema

    sentencepiece_schema.install()


def use_lean_rope(apply_rotary: Callable) -> None:
    from nemo_aligner.utils.patches import rope

    rope.install(apply_rotary)
