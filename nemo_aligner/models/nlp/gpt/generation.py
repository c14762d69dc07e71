"""Batched text generation over a megatron-core GPT's own weights, with a preallocated KV cache.

The decode loop calls the model's modules (embedding, layer norms, tensor-parallel linear
layers, output layer) directly, so tensor parallelism works unchanged, and replaces
megatron-core's attention with ``scaled_dot_product_attention`` over a cache allocated once
(no per-step concatenation, keys cached after rotation, logits for the last position only).
Prompts of different lengths are left-aligned into one batch: each row gets its own
positions and a padding mask, so a single prefill covers every prompt. On the CPU in float32, or
bf16 where the CPU has bf16 matmul units (one rank, RMSNorm models), decode steps run each layer's
glue through fused float32 C++ kernels (``cpu_kernels``); the Python step below is their reference
and the fallback.

Generation returns tokens only. Log-probs for training are recomputed by the model's
training forward, so sampling settings (temperature, top-k, top-p) cannot bias them.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_aligner.models.alignable_interface import LengthParams, SamplingParams  # noqa: F401 (re-exported)
from nemo_aligner.models.nlp.gpt import lean_ops
from nemo_aligner.models.nlp.gpt.lean_ops import rotary_from_tables
from nemo_aligner.models.nlp.gpt import lora
from nemo_aligner.models.nlp.gpt.expert_lockstep import is_moe_layer, lockstep_for, moe_inference_call
from nemo_aligner.utils import cpu_gemm, cpu_kernels, decode_buffers
from nemo_aligner.utils.cpu_info import has_fast_bf16_matmul
from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)



@dataclass
class GenerationOutput:
    """Right-padded ``tokens`` [B, T] (prompt then response), with per-row lengths and whether it ended."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor  # total tokens (prompt + response) per row
    is_end: torch.Tensor  # True where generation stopped on EOS or an end string


def built_attention_window(module) -> Optional[int]:
    """The sliding window of ``module``'s attention (``gpt_builder.attention_window``), or None."""
    window = getattr(module.config, "window_size", None)  # Transformer Engine's layer spec
    if window:
        return None if window[0] < 0 else int(window[0])
    layer = next(iter(module.decoder.layers), None)
    return getattr(layer.self_attention.core_attention, "window", None) if layer is not None else None


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _gather_vocab(logits: torch.Tensor, tp: int) -> torch.Tensor:
    """Full-vocabulary logits from ``tp`` tensor-parallel shards (last dimension)."""
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=_tp_group())
    return torch.cat(parts, dim=-1)


def _pack_linear_weights(module, batch: int, backend: str, weight_of,
                         buffers: decode_buffers.DecodeBuffers) -> dict:
    """Packed copies (``cpu_gemm.pack``, into ``buffers``) of a CPU model's 2-D weights for
    ``batch``-row matmuls, keyed by ``id(weight)``; empty where they cannot be packed.

    Packing costs one pass over the weights per ``generate`` call, so weights updated between
    rollouts are always current.
    """
    weights = []
    for layer in module.decoder.layers:
        attention, mlp = layer.self_attention, layer.mlp
        weights += [weight_of(attention.linear_qkv), weight_of(attention.linear_proj)]
        if not is_moe_layer(mlp):  # a routed layer's experts run as modules (each sees a few rows)
            weights += [weight_of(mlp.linear_fc1), weight_of(mlp.linear_fc2)]
    if getattr(module, "post_process", False):
        weights.append(module.shared_embedding_or_output_weight() if module.share_embeddings_and_output_weights
                       else module.output_layer.weight)
    packed = {}
    for index, param in enumerate(weights):
        if param is not None:
            matrix = buffers.pack(index, param, batch, backend)
            if matrix is not None:
                packed[id(param)] = matrix
    return packed


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE on the first ``2 * cos.shape[-1]`` channels of ``x``, in place: the same arithmetic as
    ``lean_ops.rotate`` (so prefill, decode and the training forward agree) without its output buffer."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    x1_before = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
    x2.mul_(cos).addcmul_(x1_before, sin)


def _cpu_rms_norm(hidden: int, weight: torch.Tensor, eps: float):
    """float32 RMSNorm in five kernels: ``x * rsqrt(||x||^2 / hidden + eps) * weight``.

    torch's CPU ``rms_norm`` is a composite of ~14 dispatches (~50 us a call inside a decode step:
    its nine calls were ~10% of the benchmark's tiny-model step); this is as accurate against float64
    (~2.5e-7 relative). Not for bf16: ``vector_norm`` would round the norm itself to bf16.
    """
    eps_tensor = torch.full((1,), eps, dtype=torch.float32)
    scale = 1.0 / hidden

    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, 2, -1, True)
        return x.mul(torch.addcmul(eps_tensor, norm, norm, value=scale).rsqrt_()).mul_(weight)

    return rms_norm


def _is_mcore_parallel_layer(module) -> bool:
    """megatron-core's own tensor-parallel linear/embedding (not Transformer Engine's): its weight
    can be used directly when tensor parallelism is 1."""
    return type(module).__module__ == "megatron.core.tensor_parallel.layers"


def _cpu_rms_norm_params(norm, dtype: torch.dtype = torch.float32) -> Optional[tuple]:
    """``(weight, eps)`` of torch's own 1-D RMSNorm with a ``dtype`` CPU weight, else None."""
    if not isinstance(norm, torch.nn.RMSNorm) or len(norm.normalized_shape) != 1:
        return None
    weight = norm.weight
    if weight is None or weight.dtype != dtype or weight.device.type != "cpu":
        return None
    return weight, torch.finfo(torch.float32).eps if norm.eps is None else norm.eps


def _widened(call, dtype: torch.dtype):
    """``call`` (a matmul or MoE layer of ``dtype``) taking and returning float32 activations; None
    stays None. A matmul with a float32 result of its own (``float_output``: our bf16 GEMM) returns
    it unrounded."""
    if call is None:
        return None
    float_output = getattr(call, "float_output", None)
    if float_output is not None:  # takes the float32 activations as they are
        return float_output
    return lambda x: call(x.to(dtype)).float()


def _direct_norm(norm):
    """``norm`` as a direct functional call when it is torch's own RMSNorm/LayerNorm (no module
    call per token); any other norm module is called as is."""
    cpu_params = _cpu_rms_norm_params(norm)
    if cpu_params is not None:
        return _cpu_rms_norm(norm.normalized_shape[0], *cpu_params)
    weight = getattr(norm, "weight", None)
    if (isinstance(norm, lean_ops.RMSNorm) and weight is not None and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"):
        # the module itself: on bf16 CPU inputs it runs the fused kernel (one pass, float32 maths,
        # as the model's own forward), where torch's bf16 norm is several passes (a bf16 prefill:
        # the small benchmark model's 25 norms 51 -> ~6 ms)
        return norm
    if isinstance(norm, torch.nn.RMSNorm) and len(norm.normalized_shape) == 1:
        shape, weight, eps = tuple(norm.normalized_shape), norm.weight, norm.eps
        return lambda x: F.rms_norm(x, shape, weight, eps)
    if type(norm) is torch.nn.LayerNorm and len(norm.normalized_shape) == 1:
        shape, weight, bias, eps = tuple(norm.normalized_shape), norm.weight, norm.bias, norm.eps
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    return norm


class KVCacheDecoder:
    """Runs this rank's pipeline stage of a megatron-core ``GPTModel`` step by step (any TP and PP).

    With pipeline parallelism each stage receives the previous stage's hidden states, runs its
    layers against its own part of the cache, and sends them on; only the last stage returns logits.
    Each layer's norms and linear layers are resolved once into direct calls (a decode step runs
    a few hundred small ops, so per-call overhead is a large share of its time).
    """

    def __init__(self, module, batch: int, max_len: int):
        from megatron.core import parallel_state

        # With expert parallelism each forward first joins a round of the expert group
        # (expert_lockstep): the group's ranks run their MoE layers together whatever each one's rows need.
        self.lockstep = lockstep_for(module)
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.module = module
        self.config = module.config
        cfg = self.config
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.heads = cfg.num_attention_heads // tp
        self.groups = (cfg.num_query_groups or cfg.num_attention_heads) // tp
        self.scale = cfg.softmax_scale or 1.0 / math.sqrt(self.head_dim)
        layers = module.decoder.layers
        param = next(module.parameters())
        dtype, self.device = param.dtype, param.device
        self.dtype = dtype
        self.tp = tp
        self.gemm_backend = cpu_gemm.decode_gemm_backend(dtype) if self.device.type == "cpu" else "plain"
        self._weights = {}  # layer -> its weight with any LoRA adapter merged in (one tensor per call)
        # Packs and cache in the model's kept CPU buffers where free (decode_buffers); given back by
        # close(), or when this decoder is collected.
        self.buffers = decode_buffers.acquire(module, self.device)
        self._give_back = weakref.finalize(self, decode_buffers.give_back, self.buffers)
        self.packed = (_pack_linear_weights(module, batch, self.gemm_backend, self._weight, self.buffers)
                       if tp == 1 else {})
        self.packed_batch = batch
        self.window = built_attention_window(module)
        self.rope = getattr(module, "rotary_pos_emb", None) if module.position_embedding_type == "rope" else None
        if self.rope is not None:  # cos/sin tables once, not per layer and step
            freqs = self.rope(max_len).squeeze(1).squeeze(1)  # [max_len, rot]: one half's angles, repeated
            half = freqs[:, : freqs.shape[-1] // 2]
            # one table, [max_len, rot]: cos then sin, so a step gathers both in one lookup
            self.rope_table_float = torch.cat((half.cos(), half.sin()), dim=-1).float()
            self.rope_table = self.rope_table_float.to(dtype)
        self.layers = [self._plan(layer) for layer in layers]
        if self.first_stage:
            self.embed = self._embedding(module.embedding)
        if getattr(module, "post_process", False):
            self.final_norm = _direct_norm(module.decoder.final_layernorm)
            weight = module.shared_embedding_or_output_weight() if module.share_embeddings_and_output_weights else None
            self.output = self._linear(module.output_layer, weight)
        self.fused = self._fused_plan(module)
        # [layer, B, group, key/value, T, d]: a group's key and value sit next to each other, as in
        # the QKV projection's output, so one copy per layer and step stores both. In the model's
        # dtype, the fused steps of a bf16 model too: reading the cache is much of a decode step.
        shape = (len(layers), batch, self.groups, 2, max_len, self.head_dim)
        self.cache = self.buffers.cache(shape, dtype, self.device)
        self.slots = torch.arange(max_len, device=self.device)  # static_step's mask of slots after the current
        self.layer_cache = list(self.cache.unbind(0))
        self.layer_keys = [c[:, :, 0] for c in self.layer_cache]  # [B, group, T, d] views
        self.layer_values = [c[:, :, 1] for c in self.layer_cache]

    def close(self) -> None:
        """Give the model's kept buffers back for its next decoder (this one must not run again)."""
        self._give_back()

    def _fused_plan(self, module) -> Optional[dict]:
        """What a decode step needs to run through the fused CPU kernels (``cpu_kernels``), or None
        where they do not apply: float32 on the CPU (or bf16 on a CPU with bf16 matmul units, see
        below), one model-parallel rank, torch RMSNorms and no query/key norms (the common
        Llama-style shape); anything else runs the Python step.

        A bf16 model's decode steps keep the residual stream, norms, RoPE and attention in float32
        through the same kernels and run only the matmuls in bf16 (the weights as they are, inputs
        rounded to bf16, outputs widened back); the cache holds the keys and values in bf16, as the
        model's own attention does (the kernels read them as float32). torch's bf16 CPU ops for that
        glue cost more than the float32 kernels (the GRPO benchmark's ``generate`` on an AMX Xeon:
        0.36 s against 0.33 s, medians of 8 alternating calls), and the float32 glue rounds less
        than the bf16 Python step."""
        upcast = self.dtype == torch.bfloat16 and has_fast_bf16_matmul()
        if (self.device.type != "cpu" or (self.dtype != torch.float32 and not upcast) or self.tp != 1
                or self.pp != 1 or not getattr(module, "post_process", False)):
            return None
        norms = []
        for layer, plan in zip(module.decoder.layers, self.layers):
            if plan["q_norm"] is not None or plan["k_norm"] is not None:
                return None
            norms += [_cpu_rms_norm_params(layer.input_layernorm, self.dtype),
                      _cpu_rms_norm_params(layer.pre_mlp_layernorm, self.dtype)]
        norms.append(_cpu_rms_norm_params(module.decoder.final_layernorm, self.dtype))
        if any(n is None for n in norms) or (self.rope is not None and self.rope_table.shape[-1] > self.head_dim):
            return None
        ext = cpu_kernels.load()
        if ext is None:
            return None
        swiglu = self.config.gated_linear_unit and self.config.activation_func is F.silu
        calls = ("qkv", "proj", "fc1", "fc2", "moe")
        layers = [{k: _widened(plan[k], self.dtype) if upcast else plan[k] for k in calls} for plan in self.layers]
        embed = self.embed  # one pipeline stage here: it is the first
        return dict(ext=ext, norms=[(w.detach().float().contiguous(), float(eps)) for w, eps in norms], swiglu=swiglu,
                    rope_table=self.rope_table_float.contiguous() if self.rope is not None else None,
                    layers=layers, output=_widened(self.output, self.dtype) if upcast else self.output,
                    embed=(lambda tokens, positions: embed(tokens, positions).float()) if upcast else embed)

    def _weight(self, linear) -> torch.Tensor:
        if id(linear) not in self._weights:
            self._weights[id(linear)] = lora.effective_weight(linear)
        return self._weights[id(linear)]

    def _linear(self, linear, weight: Optional[torch.Tensor] = None):
        """A megatron-core parallel linear layer (bias included) as a callable; without tensor
        parallelism a plain (packed where possible) matmul, with no autograd-function and
        communication wrappers per token."""
        direct = _is_mcore_parallel_layer(linear)
        # Transformer Engine's linears (some with the layer norm fused in) are called as modules.
        if self.tp > 1 or not direct:
            def call(x):
                out, bias = linear(x, weight=weight) if weight is not None else linear(x)
                return out + bias if bias is not None else out
            return call
        weight = self._weight(linear) if weight is None else weight
        return cpu_gemm.linear(weight, linear.bias, self.packed.get(id(weight)), self.packed_batch, self.gemm_backend)

    def _embedding(self, embedding):
        """``(tokens [B, S], positions [B, S]) -> [S, B, H]``: megatron-core's embedding module, or
        without tensor parallelism its lookups called directly (the module's dropout is skipped, as
        the decode loop skips every dropout)."""
        word = getattr(embedding, "word_embeddings", None)
        direct = (self.tp == 1 and type(embedding).__name__ == "LanguageModelEmbedding"
                  and _is_mcore_parallel_layer(word)
                  and getattr(embedding, "tokentype_embeddings", None) is None
                  and not self.config.fp32_residual_connection)
        if not direct:  # the module, with its hooks (apply_embedding_scaling's)
            return lambda tokens, positions: embedding(input_ids=tokens, position_ids=positions)
        weight = word.weight
        if not embedding.add_position_embedding:
            lookup = lambda tokens, positions: F.embedding(tokens.t(), weight)
        else:
            position_weight = embedding.position_embeddings.weight
            lookup = lambda tokens, positions: F.embedding(tokens.t(), weight).add_(
                F.embedding(positions.t(), position_weight))
        scale = getattr(self.module, "embedding_scale", None)
        if scale is None:
            return lookup
        factor = torch.tensor(scale, dtype=weight.dtype)  # NeMo's: the factor in the activations' dtype
        return lambda tokens, positions: lookup(tokens, positions).mul_(factor)

    def _plan(self, layer) -> dict:
        attn, mlp = layer.self_attention, layer.mlp
        q_norm, k_norm = getattr(attn, "q_layernorm", None), getattr(attn, "k_layernorm", None)
        identity = lambda m: m is None or type(m).__name__ == "IdentityOp"
        moe = is_moe_layer(mlp)
        return dict(norm1=_direct_norm(layer.input_layernorm), qkv=self._linear(attn.linear_qkv),
                    proj=self._linear(attn.linear_proj), norm2=_direct_norm(layer.pre_mlp_layernorm),
                    fc1=None if moe else self._linear(mlp.linear_fc1), fc2=None if moe else self._linear(mlp.linear_fc2),
                    moe=moe_inference_call(mlp) if moe else None,
                    q_norm=None if identity(q_norm) else q_norm, k_norm=None if identity(k_norm) else k_norm)

    def _attention(self, plan: dict, x: torch.Tensor, rope, start, mask, index: int,
                   rows: Optional[torch.Tensor], last_only: bool = False) -> torch.Tensor:
        """Self-attention of ``x`` [S, B, H] fed at cache slot ``start`` (an int; or a 1-element tensor
        from ``static_step``, whose ``mask`` covers the whole cache). ``last_only``: every slot's key
        and value go to the cache, but only the last slot's output is computed ([1, B, H])."""
        mixed = plan["qkv"](x)
        s, b = mixed.shape[:2]
        per_group = self.heads // self.groups
        # Per query group: its queries, then one key and one value head.
        mixed = mixed.view(s, b, self.groups, per_group + 2, self.head_dim)
        if plan["q_norm"] is None and plan["k_norm"] is None:
            if rope is not None:  # queries and keys rotated in place, in one call
                _rotate_in_place(mixed[:, :, :, : per_group + 1], *rope)
            query = mixed[:, :, :, :per_group]
            key_value = mixed[:, :, :, per_group:]  # [S, B, groups, 2, d]
        else:
            query = mixed[:, :, :, :per_group]
            key, value = mixed[:, :, :, per_group], mixed[:, :, :, per_group + 1]
            if plan["q_norm"] is not None:
                query = plan["q_norm"](query.reshape(s, b, self.heads, self.head_dim))
            if plan["k_norm"] is not None:
                key = plan["k_norm"](key)
            if rope is not None:
                cos, sin = rope[0].squeeze(3), rope[1].squeeze(3)
                query = rotary_from_tables(query.reshape(s, b, self.heads, self.head_dim), cos, sin)
                key = rotary_from_tables(key, cos, sin)
            key_value = torch.stack((key, value), dim=3)
        key_value = key_value.permute(1, 2, 3, 0, 4)  # [rows fed, groups, 2, S, d]
        # Keys are stored after rotation, once.
        if torch.is_tensor(start):  # static_step: the slot is data and every cache slot is read (masked)
            self.layer_cache[index].index_copy_(3, start, key_value)
            keys, values = self.layer_keys[index], self.layer_values[index]
        else:
            end = start + s
            # narrow() rather than indexing with slice tuples: fewer dispatches per layer and step
            self.layer_cache[index].narrow(3, start, s).copy_(
                key_value if rows is None else key_value.index_select(0, rows))
            if rows is None:
                keys, values = self.layer_keys[index].narrow(2, 0, end), self.layer_values[index].narrow(2, 0, end)
            else:  # a prefill of distinct prompts attends to its own keys
                keys, values = key_value[:, :, 0], key_value[:, :, 1]
        # [B, heads, S, d]; a group's query heads are adjacent
        q = query.reshape(s, b, self.heads, self.head_dim).permute(1, 2, 0, 3)
        gqa = per_group > 1  # SDPA maps query head h to key/value head h // per_group: no copied cache
        if last_only and s > 1:  # the last query sees every fed slot: causal or not, only padding masks it
            q, s = q[:, :, -1:], 1
            mask = mask[:, :, -1:] if mask is not None else None
        if mask is None and s > 1:  # no padding: a plain causal prefill
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:  # mask None here: one new token sees every cached slot
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return plan["proj"](out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        if (self.config.gated_linear_unit and self.config.activation_func is F.silu and x.dtype == torch.bfloat16
                and x.device.type == "cpu"):
            # bf16 on the CPU: the model's own SwiGLU (one fused pass, one rounding, as its forward),
            # not silu and a product each rounded to bf16 (a bf16 prefill of the small benchmark
            # model: 43 -> ~8 ms)
            return lean_ops.swiglu(x)
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(x, 2, dim=-1)
            return self.config.activation_func(gate).mul_(up)
        return self.config.activation_func(x)

    def _mlp(self, plan: dict, x: torch.Tensor) -> torch.Tensor:
        if plan["moe"] is not None:
            return plan["moe"](x)
        return plan["fc2"](self._activation(plan["fc1"](x)))

    def _fused_step(self, tokens: torch.Tensor, positions: torch.Tensor, start: int, key_mask: torch.Tensor,
                    padded: bool) -> torch.Tensor:
        """One decode step (``tokens`` [B, 1] at slot ``start``) through the fused CPU kernels: per
        layer four kernel calls around the four matmuls. Returns the logits [B, V]."""
        fused = self.fused
        ext, norms = fused["ext"], fused["norms"]
        batch = tokens.shape[0]
        per_group = self.heads // self.groups
        mask = key_mask if padded else None
        hidden = fused["embed"](tokens, positions).view(batch, -1)  # [B, H]: a fresh tensor
        weight, eps = norms[0]
        normed = ext.add_rms_norm(hidden, None, weight, eps)
        for index, plan in enumerate(fused["layers"]):
            qkv = plan["qkv"](normed)
            cache = self.layer_cache[index]
            ext.rope_cache_write(qkv, fused["rope_table"], positions[:, 0], cache, start, self.groups, per_group)
            out = plan["proj"](ext.decode_attention(qkv, cache, start + 1, mask, self.scale, self.groups, per_group))
            weight, eps = norms[2 * index + 1]
            normed = ext.add_rms_norm(out, hidden, weight, eps)  # out += hidden: the residual stream
            hidden = out
            if plan["moe"] is not None:
                out = plan["moe"](normed.unsqueeze(0)).view(batch, -1).contiguous()
            else:
                inner = plan["fc1"](normed)
                out = plan["fc2"](ext.swiglu(inner) if fused["swiglu"] else self._activation(inner))
            weight, eps = norms[2 * index + 2]  # the next layer's input norm, or the final norm
            normed = ext.add_rms_norm(out, hidden, weight, eps)
            hidden = out
        return fused["output"](normed).float()

    def _rope(self, positions: torch.Tensor):
        """(cos, sin) [S, B, 1, 1, rot/2] for ``positions`` [B, S], or None without RoPE."""
        if self.rope is None:
            return None
        table = F.embedding(positions.t(), self.rope_table)[:, :, None, None]  # [S, B, 1, 1, rot]
        half = table.shape[-1] // 2
        return table[..., :half], table[..., half:]

    @torch.inference_mode()
    def static_step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                    key_mask: torch.Tensor) -> torch.Tensor:
        """One decode step whose shapes and memory do not change from step to step, so that a CUDA
        graph can capture it: ``tokens`` and ``positions`` [B, 1] and ``slot`` (a 1-element tensor) on
        the device; every cache slot is read, those after ``slot`` and the padding (``key_mask``
        [B, T] False) masked. One rank only (no tensor or pipeline parallelism). Returns logits [B, V]."""
        hidden = self.embed(tokens, positions)
        rope = self._rope(positions)
        visible = key_mask.logical_and(self.slots <= slot)
        if self.window is not None:  # the sliding window: and not before slot - window
            visible = visible.logical_and(self.slots >= slot - self.window)
        mask = visible[:, None, None, :]  # [B, 1, 1, T]
        for index, plan in enumerate(self.layers):
            hidden = self._attention(plan, plan["norm1"](hidden), rope, slot, mask, index, None).add_(hidden)
            hidden = self._mlp(plan, plan["norm2"](hidden)).add_(hidden)
        return self.output(self.final_norm(hidden[-1:]))[0].float()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, start: int, key_mask: torch.Tensor,
                padded: Optional[bool] = None, rows: Optional[torch.Tensor] = None):
        """Feed ``tokens`` [B, S] at cache slots ``start..start+S``; returns the last slot's logits [B, V]
        (inference-mode tensors) on the last pipeline stage (None on the others). ``padded``: whether
        any of ``key_mask`` is False (computed here when not given).

        ``rows`` (a prefill, ``start`` 0): ``tokens``, ``positions`` and ``key_mask`` hold only distinct
        prompts and cache row ``b`` gets fed row ``rows[b]`` (GRPO/RLOO groups repeat each prompt: it is
        run once); the logits come back for all cache rows.
        """
        from megatron.core import parallel_state

        if rows is not None and start != 0:
            raise ValueError("rows: only a prefill (start 0) can feed distinct prompts")
        if self.lockstep is not None:
            self.lockstep.before_forward()
        device = self.device  # inputs may come from the host; on the CPU these are no-ops
        tokens, positions, key_mask = tokens.to(device), positions.to(device), key_mask.to(device)
        rows = rows.to(device) if rows is not None else None
        s = tokens.shape[1]
        end = start + s
        if padded is None:
            padded = not bool(key_mask[:, :end].all())
        if self.window is not None and s == 1 and start > self.window:  # slots before the window hidden
            key_mask = key_mask.clone()
            key_mask[:, : start - self.window] = False
            padded = True
        windowed = self.window is not None and s > 1 and end > self.window + 1
        if self.fused is not None and s == 1 and rows is None:
            return self._fused_step(tokens, positions, start, key_mask, padded)

        if self.first_stage:
            hidden = self.embed(tokens, positions)  # [S, B, H]
        else:
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], self.config.hidden_size, dtype=self.dtype,
                                 device=device)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        rope = self._rope(positions)
        mask = None
        if s == 1:  # one new token sees every real cached slot: no causal part, no mask without padding
            mask = key_mask[:, None, None, :end] if padded else None
        elif padded or start > 0 or windowed:
            causal = torch.ones(s, end, dtype=torch.bool, device=device).tril(diagonal=start)
            if windowed:  # slot start + i sees slots start + i - window .. start + i
                causal = causal.triu(diagonal=start - self.window)
            mask = (causal.unsqueeze(0) & key_mask[:, None, :end]).unsqueeze(1)  # [B, 1, S, T]
        last = len(self.layers) - 1
        for index, plan in enumerate(self.layers):
            # Only the last slot's logits are returned: the last layer needs every slot's key and value
            # (the cache) but its output projection and MLP only for the last slot.
            last_only = self.last_stage and index == last and s > 1
            out = self._attention(plan, plan["norm1"](hidden), rope, start, mask, index, rows, last_only)
            hidden = out.add_(hidden[-1:] if last_only else hidden)
            hidden = self._mlp(plan, plan["norm2"](hidden)).add_(hidden)
        if not self.last_stage:
            dist.send(hidden.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        logits = self.output(self.final_norm(hidden[-1:]))[0]
        if rows is not None:
            logits = logits.index_select(0, rows)
        return _gather_vocab(logits.float(), self.tp)


class CUDAGraphDecodeStep:
    """``KVCacheDecoder.static_step`` for one batch, captured once as a CUDA graph: each decode step
    copies its token, positions and slot into the captured buffers and replays the graph, one launch
    instead of a few hundred small kernels (decode of small and mid-sized models is launch-bound)."""

    def __init__(self, decoder: KVCacheDecoder, key_mask: torch.Tensor, first_slot: int):
        device = decoder.device
        batch = key_mask.shape[0]
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.full((1,), first_slot, dtype=torch.long, device=device)
        self.key_mask = key_mask
        # torch's rule: warm up on a side stream before capturing. The warm-up writes cache slot
        # ``first_slot``, which the first real step overwrites before any step reads it.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                decoder.static_step(self.tokens, self.positions, self.slot, self.key_mask)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decoder.static_step(self.tokens, self.positions, self.slot, self.key_mask)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits [B, V] for ``tokens`` [B, 1] at ``positions`` [B, 1] and cache slot ``slot``; the
        tensor is the graph's own output buffer, overwritten by the next call."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slot.fill_(slot)
        self.graph.replay()
        return self.logits


def cuda_graphs_enabled() -> bool:
    """``NEMO_ALIGNER_CUDA_GRAPHS=1``: decode steps on a GPU replay a captured CUDA graph."""
    return os.environ.get("NEMO_ALIGNER_CUDA_GRAPHS", "0").strip().lower() in ("1", "true", "yes")


def _graphed_step(decoder: KVCacheDecoder, key_mask: torch.Tensor, first_slot: int, steps: int):
    """The CUDA-graph decode step where it applies (enabled, a GPU, one rank, more than one step),
    else None; a capture that fails falls back to the eager step with a warning."""
    # A routed layer's experts see a data-dependent number of rows: no fixed graph can hold them.
    if not (cuda_graphs_enabled() and decoder.device.type == "cuda" and decoder.tp == 1 and decoder.pp == 1
            and steps > 1 and decoder.lockstep is None and not any(plan["moe"] is not None for plan in decoder.layers)):
        return None
    try:
        return CUDAGraphDecodeStep(decoder, key_mask, first_slot)
    except Exception as err:  # noqa: BLE001 - any capture failure: the eager step still works
        logger.warning("CUDA graph capture of the decode step failed (%s: %s); decoding without it",
                       type(err).__name__, err)
        return None


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row from [B, V] logits."""
    if params.use_greedy:
        return logits.argmax(dim=-1)
    if params.temperature != 1.0:
        logits = logits / max(params.temperature, 1e-6)
    if params.top_k and params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the probability mass before it already reaches top_p (the first always stays,
        # also for top_p <= 0, which would otherwise drop every token).
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return _inverse_cdf_sample(torch.softmax(logits, dim=-1), generator)


def _inverse_cdf_sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One draw per row of ``probs`` [B, V]: the first index whose cumulative probability exceeds a
    uniform draw. One random number per row (``torch.multinomial`` draws one per vocabulary entry,
    the largest cost of a CPU decode step after the matmuls and attention); zero-probability
    entries are never chosen."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


class EndStringMatcher:
    """Whether a response's decoded tail (its last ``TAIL`` tokens) ends with one of ``end_strings``.

    Decoding every row's tail at every step costs more than the rest of a small model's decode
    step, so the tail is decoded only when the newest token could end an end string: its own text
    ends with an end string's last character, or it decodes alone to nothing or to part of a
    character (where decoding in context may differ). Any other token cannot end one.
    """

    TAIL = 16

    def __init__(self, tokenizer, end_strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.end_strings = list(end_strings)
        self.last_chars = {s[-1] for s in self.end_strings if s}
        self.any_empty = any(not s for s in self.end_strings)
        self._could_end = {}  # token id -> bool, filled as tokens appear

    def could_end(self, token: int) -> bool:
        hit = self._could_end.get(token)
        if hit is None:
            text = self.tokenizer.ids_to_text([token])
            hit = self.any_empty or not text or "\ufffd" in text or text[-1] in self.last_chars
            self._could_end[token] = hit
        return hit

    def ended(self, ids: Sequence[int]) -> bool:
        """Whether the response ``ids`` (at least its last ``TAIL`` tokens) ends with an end string."""
        if not self.end_strings or not len(ids) or not self.could_end(int(ids[-1])):
            return False
        tail = self.tokenizer.ids_to_text(list(ids[-self.TAIL:]))
        return any(tail.endswith(s) for s in self.end_strings)


def generate(module, tokenizer, prompts: Sequence[Sequence[int]], sampling: SamplingParams, length: LengthParams,
             max_sequence_length: Optional[int] = None, seed: Optional[int] = None) -> GenerationOutput:
    """Generate up to ``length.max_length`` tokens after each prompt (token id lists), and no more than
    ``max_sequence_length`` tokens per row in all (each row's own limit: a long prompt does not cut
    the others' responses short).

    Collective over the model-parallel group (every rank must pass the same prompts) and, with
    expert parallelism, over the expert group in rounds (``expert_lockstep``); the sampled tokens come from TP rank 0 of the last pipeline stage. A row stops at EOS or when its decoded tail ends with
    one of ``sampling.end_strings``; EOS is refused before ``length.min_length`` tokens.
    """
    # Inference mode skips autograd's per-op bookkeeping (a decode step is a few hundred small ops);
    # its tensors cannot enter autograd later, so the outputs (training inputs) are copied out of it.
    with torch.inference_mode():
        out = _generate(module, tokenizer, prompts, sampling, length, max_sequence_length, seed)
    return GenerationOutput(out.tokens.clone(), out.prompt_lengths.clone(), out.response_lengths.clone(),
                            out.is_end.clone())


def _generate(module, tokenizer, prompts: Sequence[Sequence[int]], sampling: SamplingParams, length: LengthParams,
              max_sequence_length: Optional[int], seed: Optional[int]) -> GenerationOutput:
    from megatron.core import parallel_state

    if module.config.sequence_parallel:
        raise ConfigError("model.sequence_parallel=True is not supported for generation yet; set it to False")
    batch = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    if (prompt_lengths < 1).any():
        raise ValueError("every prompt needs at least one token")
    longest = int(prompt_lengths.max())
    # Each row's own budget: a long prompt near max_sequence_length must not cut the other rows short.
    budget = torch.full((batch,), max(int(length.max_length), 0), dtype=torch.long)
    if max_sequence_length is not None:
        budget = budget.minimum((max_sequence_length - prompt_lengths).clamp(min=0))
    new_tokens = int(budget.max())
    total = longest + new_tokens
    # Left-align: row b's prompt occupies slots [longest - P_b, longest).
    pad = longest - prompt_lengths
    tokens = torch.full((batch, total), tokenizer.eos_id, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        tokens[b, pad[b]:longest] = torch.tensor(list(prompt), dtype=torch.long)
    slots = torch.arange(total).unsqueeze(0)
    positions = (slots - pad.unsqueeze(1)).clamp(min=0)
    if max_sequence_length is not None:  # slots after a row's budget hold filler: keep them in the tables
        positions = positions.clamp(max=max(max_sequence_length, longest) - 1)
    key_mask = slots >= pad.unsqueeze(1)  # padding slots are never attended to
    decoder = KVCacheDecoder(module, batch, total)
    try:
        # The decoder's inputs live on its device (moved once, not per step); sampling runs where the
        # logits are; the bookkeeping below (tokens, done, lengths) stays on the host.
        positions, key_mask = positions.to(decoder.device), key_mask.to(decoder.device)
        generator = torch.Generator(device=decoder.device).manual_seed(seed) if seed is not None else None
        tp_rank0 = parallel_state.get_tensor_model_parallel_src_rank()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        last_stage = parallel_state.is_pipeline_last_stage()

        matcher = EndStringMatcher(tokenizer, sampling.end_strings) if sampling.end_strings else None
        done = budget == 0
        is_end = torch.zeros(batch, dtype=torch.bool)
        generated = torch.zeros(batch, dtype=torch.long)
        padded = not bool(key_mask.all())
        # GRPO/RLOO repeat each prompt per response: prefill each distinct prompt once.
        distinct = {}
        first = torch.tensor([distinct.setdefault(tuple(p), b) for b, p in enumerate(prompts)], dtype=torch.long)
        fed, rows = slice(None), None
        if len(distinct) < batch:
            fed = torch.tensor(sorted(distinct.values()), dtype=torch.long)
            rows = torch.searchsorted(fed, first)  # cache row -> its prompt's row among those fed
        logits = decoder.forward(tokens[fed, :longest], positions[fed, :longest], 0, key_mask[fed], padded, rows)
        graphed = _graphed_step(decoder, key_mask, longest, new_tokens)
        for step in range(new_tokens):
            if last_stage:
                logits = logits[:, : tokenizer.vocab_size]  # vocabulary padding rows are never sampled
                if step < length.min_length:
                    logits[:, tokenizer.eos_id] = float("-inf")
                token = sample(logits, sampling, generator)
                if tp > 1:
                    dist.broadcast(token, src=tp_rank0, group=_tp_group())
            else:
                token = torch.zeros(batch, dtype=torch.long, device=decoder.device)
            if pp > 1:  # every stage needs the new tokens (the first embeds them, all track the ends)
                dist.broadcast(token, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
            # A fresh tensor from sampling (or the broadcast): safe to edit in place. Finished rows get EOS.
            token = token.cpu().masked_fill_(done, tokenizer.eos_id)
            slot = longest + step
            tokens.select(1, slot).copy_(token)
            alive = ~done
            generated += alive
            stop = token == tokenizer.eos_id
            if matcher is not None:
                new, finished = token.tolist(), done.tolist()
                tail_start = max(longest, slot + 1 - matcher.TAIL)
                stop |= torch.tensor([not finished[b] and matcher.could_end(new[b])
                                      and matcher.ended(tokens[b, tail_start : slot + 1].tolist()) for b in range(batch)])
            is_end |= alive.logical_and_(stop)
            done |= stop | (generated >= budget)
            if bool(done.all()) or step == new_tokens - 1:
                break
            if graphed is not None:
                logits = graphed(token.unsqueeze(1), positions[:, slot : slot + 1], slot)
            else:
                logits = decoder.forward(token.unsqueeze(1), positions[:, slot : slot + 1], slot, key_mask, padded)

        # Back to right padding: [prompt][response][eos padding]. Every row fits max_sequence_length, so
        # the width does too (unless a prompt alone is longer).
        width = total if max_sequence_length is None else max(min(total, max_sequence_length), longest)
        out = torch.full((batch, width), tokenizer.eos_id, dtype=torch.long)
        for b in range(batch):
            p, g = int(prompt_lengths[b]), int(generated[b])
            out[b, :p] = tokens[b, pad[b]:longest]
            out[b, p : p + g] = tokens[b, longest : longest + g]
        return GenerationOutput(out, prompt_lengths, prompt_lengths + generated, is_end)
    finally:
        decoder.close()
