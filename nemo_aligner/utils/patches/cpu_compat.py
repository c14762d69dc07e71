"""Patches that let megatron-core 0.16 run on a machine without CUDA.

megatron-core assumes a GPU in a handful of places. Every patch below is applied
once, only when ``torch.cuda.is_available()`` is False, and each says which
megatron-core code needs it; one more routes float32 linear layers to our CPU GEMM
(``_patch_native_linears``). Nothing here changes behaviour on a GPU machine.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
import types

import torch

from nemo_aligner.utils.cpu_info import has_fast_bf16_matmul
from nemo_aligner.utils.patches.deferred_compile import megatron_import_deferrals

_APPLIED = False

# Modules whose hard-coded ``device="cuda"`` factory calls and ``torch.cuda.*``
# calls are redirected to the CPU (see ``_TorchOnCpu``).
_CUDA_HARDCODED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = zeros(device="cuda")
    "megatron.core.pipeline_parallel.p2p_communication",  # torch.cuda.synchronize()
    "megatron.core.optimizer.clip_grads",  # grad-norm buffers on "cuda"
    "megatron.core.optimizer.optimizer",  # found_inf / _scale_one on "cuda", .cuda() on reload
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors on "cuda"
    "megatron.core.optimizer.distrib_optimizer",  # gather buffers on current_device()
    "megatron.core.distributed.param_and_grad_buffer",  # warm-up tensor on "cuda"
    "megatron.core.distributed.distributed_data_parallel",  # synchronize / empty_cache
    "megatron.core.distributed.finalize_model_grads",  # num_tokens buffers
    "megatron.core.transformer.utils",  # get_default_causal_mask(device="cuda")
    "megatron.core.tensor_parallel.data",  # broadcast_data sizes on "cuda"
    "megatron.core.utils",  # l2 norms, timers, param hashes
    "megatron.core.parallel_state",  # torch.cuda.synchronize() in barriers
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # verify-reuse flag on "cuda"
    "megatron.core.dist_checkpointing.exchange_utils",  # exchange buffers on "cuda"
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # synchronize() before writing
    "megatron.core.dist_checkpointing.strategies.async_utils",  # liveness flags on current_device()
    "megatron.core.dist_checkpointing.strategies.fully_parallel",  # synchronize() around exchanges
    "megatron.core.inference.text_generation_controllers.text_generation_controller",
    "megatron.core.inference.engines.static_engine",
    "megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper",
    "megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper",
    "megatron.core.inference.contexts.static_context",
)

_FACTORIES = frozenset(
    {
        "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
        "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye", "linspace",
        "triu", "tril",
    }
)


def _cpu_device(device):
    """Map any CUDA device spec to the CPU; leave others alone."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    return device


def _redirect_device(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return call


class CpuEvent:
    """Stand-in for ``torch.cuda.Event`` with wall-clock timing (inference engine, timers)."""

    def __init__(self, enable_timing: bool = False, **_):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end: "CpuEvent") -> float:
        return (end._t - self._t) * 1000.0


def _current_device():
    return torch.device("cpu")


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as seen from megatron-core modules when there is no GPU."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        overrides = {
            "current_device": _current_device,
            "synchronize": lambda *a, **k: None,
            "empty_cache": lambda *a, **k: None,
            "Event": CpuEvent,
            "stream": lambda *a, **k: contextlib.nullcontext(),
            "current_stream": lambda *a, **k: None,
            "memory_allocated": lambda *a, **k: 0,
            "max_memory_allocated": lambda *a, **k: 0,
        }
        if name in overrides:
            return overrides[name]
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen from megatron-core modules that hard-code ``device="cuda"``.

    Factory functions get CUDA devices rewritten to the CPU and ``torch.cuda``
    becomes ``_CudaOnCpu``; everything else is the real ``torch``.
    """

    def __init__(self):
        super().__init__("torch")
        self._cuda = _CudaOnCpu()
        self._wrapped = {name: _redirect_device(getattr(torch, name)) for name in _FACTORIES}

    def __getattr__(self, name):
        if name == "cuda":
            return self._cuda
        if name in self._wrapped:
            return self._wrapped[name]
        return getattr(torch, name)


@contextlib.contextmanager
def _tensors_look_like_cuda():
    """Inside megatron-core code that insists on CUDA tensors, let CPU tensors pass.

    ``Tensor.type()`` reports CUDA type names (optimizers compare ``param.type()``
    with ``'torch.cuda.FloatTensor'``) and ``Tensor.cuda()`` returns the tensor
    itself (code that moves a tensor "back to the GPU" before a collective).
    Scoped to the wrapped call so user code never sees it.
    """
    original_type, original_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original_type(self).replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kwargs)

    def cuda_(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    torch.Tensor.type, torch.Tensor.cuda = type_, cuda_
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = original_type, original_cuda


def _scoped(fn):
    """Run ``fn`` inside ``_tensors_look_like_cuda``."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _tensors_look_like_cuda():
            return fn(*args, **kwargs)

    return call


def _patch_rng_tracker():
    """Replace the CUDA RNG tracker with one that forks the CPU generator.

    tensor_parallel.random.CudaRNGStatesTracker calls torch.cuda.get/set_rng_state;
    attention always forks the tracker (even with dropout 0) and
    model_parallel_cuda_manual_seed seeds it. Activation recompute uses
    _get/_set_cuda_rng_state.
    """
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs):
        if mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED and not force_reset:
            return
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    mrandom._get_cuda_rng_state = get_cuda_rng_state
    mrandom._set_cuda_rng_state = set_cuda_rng_state
    # model_parallel_cuda_manual_seed ends with torch.cuda.manual_seed, which is a
    # silent no-op without CUDA; the tracker seeds above are what matter.
    mrandom.torch = _TorchOnCpu()


def _patch_tensor_checks():
    """Scope ``_tensors_look_like_cuda`` to the megatron-core calls that need it."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import data as tp_data

    # Float16OptimizerWithFloat16Params.__init__ and
    # DistributedOptimizer._build_model_and_main_param_groups reject params whose
    # type() is not 'torch.cuda.*Tensor'.
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _scoped(
        optimizer.Float16OptimizerWithFloat16Params.__init__
    )
    build = distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups.__func__
    distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups = classmethod(_scoped(build))
    # MegatronOptimizer.restore_from_cpu (RL optimizer offload) moves states back with .cuda().
    optimizer.MegatronOptimizer.restore_from_cpu = _scoped(optimizer.MegatronOptimizer.restore_from_cpu)
    # clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'.
    clip = _scoped(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip
    # LanguageModule.setup_embeddings_and_output_layer calls weight.data.cuda() before
    # all-reducing the tied embedding between the first and last pipeline stages.
    LanguageModule.setup_embeddings_and_output_layer = _scoped(LanguageModule.setup_embeddings_and_output_layer)
    # broadcast_data (tensor-parallel batch broadcast) flattens with .cuda().
    tp_data.broadcast_data = _scoped(tp_data.broadcast_data)


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm`` in one foreach pass (megatron-core's local fallback takes each
    tensor's norm to a Python float)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1).float(), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``: ``dst = src * scale`` in foreach passes."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _patch_multi_tensor_ops():
    """Gradient clipping without apex or Transformer Engine: megatron-core falls back to per-tensor
    Python loops (a norm and a ``.item()`` per gradient, a product and a copy per gradient)."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer

    if getattr(clip_grads, "l2_norm_impl", None) is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    for module in (clip_grads, optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is mutils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _foreach_scale


class _WgradAccumulation:
    """CPU stand-in for megatron-core's ``fused_weight_gradient_mlp_cuda`` extension (gradient
    accumulation fusion): ``main_grad += grad_output^T @ input`` as one GEMM with beta=1, instead of
    a weight gradient in a fresh buffer that DDP then adds to ``main_grad`` (a full extra pass
    over every weight per micro-batch)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        if (total_input.device.type == "cpu" and total_input.dtype == grad_output.dtype == torch.bfloat16
                and has_fast_bf16_matmul()):
            # bf16 activations on a CPU with bf16 matmul units: the GEMM in bf16 (float32 sums,
            # one rounding of the micro-batch's gradient), then added to main_grad, as megatron-core
            # does without the fused kernel; a float32 GEMM would run ~6x slower there
            main_grad.add_(torch.mm(grad_output.t(), total_input))
            return
        # elsewhere: accumulate in main_grad's precision, as the CUDA kernel does
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _patch_wgrad_accumulation():
    """Let megatron-core's linear layers accumulate weight gradients in place
    (``gradient_accumulation_fusion``; trainable models turn it on, see ``MegatronGPTModel``)."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _WgradAccumulation
        layers._grad_accum_fusion_available = True


def _patch_native_linears():
    """float32 linear layers on our CPU GEMM where it is the packed-GEMM choice (``cpu_gemm``):
    megatron-core's layers call these two functions by their module-level names."""
    from megatron.core.tensor_parallel import layers

    from nemo_aligner.utils import cpu_gemm

    for name in ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight"):
        original = getattr(layers, name, None)
        if original is not None and not getattr(original, "nemo_aligner_native", False):
            setattr(layers, name, cpu_gemm.native_linear_or(original))


def _patch_grad_scaler_reload():
    """fp16 resume: ``DynamicGradScaler.load_state_dict`` moves the saved loss scale with ``.cuda()``
    (a tensor method the module redirection cannot reach); keep it on the CPU."""
    from megatron.core.optimizer import grad_scaler

    def load_state_dict(self, state_dict):
        self._scale = state_dict["scale"].to("cpu", torch.float)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]

    grad_scaler.DynamicGradScaler.load_state_dict = load_state_dict


def apply_cpu_patches() -> bool:
    """Apply every patch once when CUDA is absent. Returns True if patches are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    # rotary_pos_embedding.get_emb, GlobalMemoryBuffer, grad buffers and p2p call
    # torch.cuda.current_device() directly and move tensors there.
    torch.cuda.current_device = _current_device

    fake_torch = _TorchOnCpu()
    with megatron_import_deferrals():  # the inference engines import wandb (~0.6 s)
        for name in _CUDA_HARDCODED_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if getattr(module, "torch", None) is torch:
                module.torch = fake_torch

    _patch_rng_tracker()
    _patch_tensor_checks()
    _patch_multi_tensor_ops()
    _patch_wgrad_accumulation()
    _patch_native_linears()
    _patch_grad_scaler_reload()
    _APPLIED = True
    return True
