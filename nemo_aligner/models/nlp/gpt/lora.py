"""LoRA adapters on megatron-core's parallel linear layers (NeMo's ``model.peft.lora_tuning`` keys).

An adapter adds ``scale * dropout(B(A(x)))`` to its layer's output (``scale = alpha / adapter_dim``;
``dropout_position: pre`` drops ``x`` instead), through a forward hook: the layer's own weights and
their checkpoint names stay as they are. The adapter sits where NeMo keeps it,
``<self_attention|mlp>.adapter_layer.<name>.linear_in/linear_out``, so adapter checkpoints use NeMo's
key names. ``variant: canonical`` puts separate query/key/value (and gate/up) adapters on the fused
``linear_qkv`` (and gated ``linear_fc1``), as NeMo's unfused adapters do.

On a mixture-of-experts layer the ``mlp_fc1``/``mlp_fc2`` targets put one adapter on each routed
expert's ``linear_fc1``/``linear_fc2`` (NeMo's ``lora_moe_hto4h_adapter``/``lora_moe_4htoh_adapter``;
shared experts and the router get none, as in NeMo). NeMo's files key expert ``i``'s adapter
``mlp.experts.local_experts.<i>.adapter_layer.<name>.expert_adapters.<i>.linear_in/linear_out``
(NeMo builds a list of adapters per expert and uses entry ``i``); the other entries are not read.
With expert parallelism each rank holds its experts' adapters; they are reduced over the
expert-data-parallel group as megatron-core reduces the experts' own weights (``allreduce=False``),
initialised and keyed by the expert's global index, and gathered to the writing rank, so the files
are those of a run without expert parallelism.

Tensor parallelism splits one half of each adapter, as the layer it sits on:
- on a column-parallel layer (``linear_qkv``, ``linear_fc1``) ``A`` [r, in] is whole on every rank and
  ``B`` holds this rank's output rows; the gradient of ``A``'s output is summed over the ranks;
- on a row-parallel layer (``linear_proj``, ``linear_fc2``) ``A`` holds this rank's input columns, its
  output is summed over the ranks, and ``B`` [out, r] is whole on every rank.
Initial values are drawn for the whole matrix from a generator seeded per layer and target, then
split, so a run starts from the same adapters at any TP size.

(peft's LoRA on Megatron layers, ``LoraConfig(megatron_config=...)``, does not run on megatron-core's
layers: its dispatcher fails on a missing ``fan_in_fan_out`` argument and its forward feeds the
layers' ``(output, bias)`` tuples to ``nn.Linear``.)
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.model_config import sequence_parallel_on

# NeMo's target names -> (sub-module of the layer, linear in it, NeMo's adapter name, parallel kind)
TARGETS = {
    "attention_qkv": ("self_attention", "linear_qkv", "lora_kqv_adapter", "column"),
    "attention_dense": ("self_attention", "linear_proj", "lora_dense_attention_adapter", "row"),
    "mlp_fc1": ("mlp", "linear_fc1", "lora_hto4h_adapter", "column"),
    "mlp_fc2": ("mlp", "linear_fc2", "lora_4htoh_adapter", "row"),
}
# NeMo's adapter names on a routed layer's experts, by target
MOE_ADAPTERS = {"mlp_fc1": "lora_moe_hto4h_adapter", "mlp_fc2": "lora_moe_4htoh_adapter"}
# ``variant: canonical``: NeMo's unfused adapters (one per output block of the fused layer), by target
CANONICAL = {"attention_qkv": ("lora_unfused_kqv_adapter", ("q_adapter", "k_adapter", "v_adapter")),
             "mlp_fc1": ("lora_unfused_hto4h_adapter", ("gate_adapter", "up_adapter"))}
GROUPS = {"attention": ("attention_qkv", "attention_dense"), "mlp": ("mlp_fc1", "mlp_fc2"), "all": tuple(TARGETS)}
ADAPTER_TAG = ".adapter_layer."
_INITS = ("xavier", "normal", "kaiming", "zero")
_KEYS = "model.peft.lora_tuning"


@dataclass(frozen=True)
class LoraSettings:
    targets: Tuple[str, ...]
    dim: int
    alpha: float
    dropout: float
    in_init: str
    out_init: str
    layers: Optional[frozenset]  # 1-based layer numbers, None: every layer
    variant: str = "nemo"  # "nemo": one adapter per layer; "canonical": NeMo's unfused q/k/v, gate/up adapters
    dropout_position: str = "post"  # dropout on the adapter's output (NeMo's default) or its input ("pre")

    @property
    def scale(self) -> float:
        return self.alpha / self.dim


def peft_scheme(model_cfg) -> str:
    peft = model_cfg.get("peft") or {}
    scheme = peft.get("peft_scheme", "none")
    return "none" if scheme is None else str(scheme).lower()


def lora_settings(model_cfg) -> Optional[LoraSettings]:
    """The run's LoRA settings (``model.peft``), None without LoRA; a bad value is a ``ConfigError``
    naming its key."""
    scheme = peft_scheme(model_cfg)
    if scheme == "none":
        return None
    if scheme != "lora":
        raise ConfigError(f"model.peft.peft_scheme={scheme!r} is not supported (supported: lora, none)")
    tuning = (model_cfg.get("peft") or {}).get("lora_tuning") or {}
    names = tuning.get("target_modules", ["attention_qkv"])
    names = [names] if isinstance(names, str) else list(names or [])
    targets: List[str] = []
    for name in names:
        name = str(name)
        if name not in TARGETS and name not in GROUPS:
            raise ConfigError(f"{_KEYS}.target_modules: {name!r} is not one of "
                              f"{', '.join(list(TARGETS) + list(GROUPS))}")
        targets += [t for t in GROUPS.get(name, (name,)) if t not in targets]
    if not targets:
        raise ConfigError(f"{_KEYS}.target_modules is empty")
    dim = tuning.get("adapter_dim", 32)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ConfigError(f"{_KEYS}.adapter_dim={dim!r} must be a positive integer")
    alpha = tuning.get("alpha")
    alpha = dim if alpha is None else alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"{_KEYS}.alpha={alpha!r} must be a positive number (null: adapter_dim, scale 1)")
    dropout = tuning.get("adapter_dropout", 0.0) or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"{_KEYS}.adapter_dropout={dropout!r} must be in [0, 1)")
    inits = []
    for key, default in (("column_init_method", "xavier"), ("row_init_method", "zero")):
        value = str(tuning.get(key, default) or default).lower()
        if value not in _INITS:
            raise ConfigError(f"{_KEYS}.{key}={value!r} is not one of {', '.join(_INITS)}")
        inits.append(value)
    layers = tuning.get("layer_selection")
    if layers is not None:
        layers = list(layers) if not isinstance(layers, int) else [layers]
        num_layers = int(model_cfg.get("num_layers", 0) or 0)
        for n in layers:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (num_layers and n > num_layers):
                raise ConfigError(f"{_KEYS}.layer_selection: {n!r} is not a layer number (1 to {num_layers})")
        layers = frozenset(layers)
    if tuning.get("weight_tying", False):
        raise ConfigError(f"{_KEYS}.weight_tying=True is not supported: each layer has its own adapters")
    choices = {}
    for key, allowed in (("variant", ("nemo", "canonical")), ("dropout_position", ("post", "pre"))):
        value = tuning.get(key) or allowed[0]
        if value not in allowed:
            raise ConfigError(f"{_KEYS}.{key}={value!r} is not one of {', '.join(allowed)}")
        choices[key] = value
    if sequence_parallel_on(model_cfg):
        raise ConfigError("model.sequence_parallel=True is not supported with LoRA (model.peft.peft_scheme=lora); "
                          "set it to False")
    return LoraSettings(tuple(targets), dim, float(alpha), float(dropout), inits[0], inits[1], layers, **choices)


def _init(tensor: torch.Tensor, method: str, generator: torch.Generator) -> None:
    if method == "zero":
        tensor.zero_()
    elif method == "normal":  # NeMo's "normal": std 0.2
        tensor.normal_(0.0, 0.2, generator=generator)
    elif method == "kaiming":
        bound = 1.0 / math.sqrt(tensor.shape[1])  # kaiming_uniform_ with a = sqrt(5), torch's Linear default
        tensor.uniform_(-bound, bound, generator=generator)
    else:  # xavier_normal_
        std = math.sqrt(2.0 / float(tensor.shape[0] + tensor.shape[1]))
        tensor.normal_(0.0, std, generator=generator)


def _rows_of_rank(full: torch.Tensor, tp: int, rank: int, gated: bool) -> torch.Tensor:
    """This rank's output rows of a column-parallel layer's weight (a gated fc1 splits each half)."""
    if tp == 1:
        return full
    if gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    return full.chunk(tp, dim=0)[rank]


class LoraAdapter(torch.nn.Module):
    """``scale * B(A(dropout(x)))`` for one parallel linear layer; ``linear_in`` is A, ``linear_out`` B."""

    def __init__(self, in_features: int, out_features: int, kind: str, settings: LoraSettings, seed: int,
                 gated: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        from megatron.core import parallel_state

        self.kind, self.gated, self.scale = kind, gated, settings.scale
        self.dropout_after = settings.dropout_position == "post"
        self.enabled = True
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else torch.nn.Identity()
        generator = torch.Generator().manual_seed(seed)
        a = torch.empty(settings.dim, in_features)
        b = torch.empty(out_features, settings.dim)
        _init(a, settings.in_init, generator)
        _init(b, settings.out_init, generator)
        if kind == "column":
            b = _rows_of_rank(b, self.tp, rank, gated)
        else:
            a = a.chunk(self.tp, dim=1)[rank]
        self.linear_in = torch.nn.Linear(a.shape[1], a.shape[0], bias=False, device=device, dtype=dtype)
        self.linear_out = torch.nn.Linear(b.shape[1], b.shape[0], bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.linear_in.weight.copy_(a)
            self.linear_out.weight.copy_(b)
        split = self.linear_out.weight if kind == "column" else self.linear_in.weight
        if self.tp > 1:
            from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel

        x = x.to(self.linear_in.weight.dtype)
        h = F.linear(x if self.dropout_after else self.dropout(x), self.linear_in.weight)
        if self.tp > 1:
            # column: every rank's B needs A's gradient summed; row: the ranks' partial sums of A x
            h = (tensor_parallel.copy_to_tensor_model_parallel_region(h) if self.kind == "column"
                 else tensor_parallel.reduce_from_tensor_model_parallel_region(h))
        out = F.linear(h, self.linear_out.weight)
        # a row-parallel adapter's output is whole on every tensor-parallel rank: the ranks of a stage
        # share torch's default generator (seed_everything), so they drop the same elements
        return (self.dropout(out) if self.dropout_after else out) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` for this rank's shard of the layer's weight, in float32."""
        return (self.linear_out.weight.float() @ self.linear_in.weight.float()) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axis = {"linear_out.weight": 0} if self.kind == "column" else {"linear_in.weight": 1}
        sharded = make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets)
        if self.gated and self.kind == "column" and self.tp > 1:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}linear_out.weight"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets)
        return sharded


class UnfusedLoraAdapter(torch.nn.Module):
    """NeMo's canonical variant on a fused column-parallel layer: one adapter per output block (query,
    key, value of ``linear_qkv``; gate, up of a gated ``linear_fc1``), each with its own ``A``, their
    outputs laid out as the layer's (this rank's query groups, each ``[queries, key, value]``; or
    ``[gate; up]``)."""

    kind, gated = "column", False

    def __init__(self, names: Tuple[str, ...], out_sizes: Tuple[int, ...], in_features: int,
                 settings: LoraSettings, seed: int, groups: int = 0, dtype=torch.float32, device=None):
        super().__init__()
        self.names, self.groups, self.enabled = names, groups, True
        for i, (name, size) in enumerate(zip(names, out_sizes)):
            child = LoraAdapter(in_features, size, "column", settings, seed=seed * 7 + i + 1, dtype=dtype,
                                device=device)
            child.part_of_unfused = True
            setattr(self, name, child)

    def parts(self) -> List[LoraAdapter]:
        return [getattr(self, name) for name in self.names]

    def _layout(self, blocks: List[torch.Tensor], dim: int) -> torch.Tensor:
        """The blocks (along ``dim``) in the fused layer's row order on this rank."""
        if not self.groups:  # [gate; up]
            return torch.cat(blocks, dim=dim)
        dim = dim % blocks[0].dim()
        per_group = [b.unflatten(dim, (self.groups, b.shape[dim] // self.groups)) for b in blocks]
        return torch.cat(per_group, dim=dim + 1).flatten(dim, dim + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._layout([part(x) for part in self.parts()], -1)

    def delta_weight(self) -> torch.Tensor:
        return self._layout([part.delta_weight() for part in self.parts()], 0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        out = {}
        for name in self.names:
            out.update(getattr(self, name).sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return out


class AdapterLayer(torch.nn.ModuleDict):
    """A layer's adapters by NeMo's names, checkpointed with their tensor-parallel splits."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        out = {}
        for name, adapter in self.items():
            out.update(adapter.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return out


def _hook(adapter: LoraAdapter):
    def add_adapter(module, args, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(args[0]).to(out.dtype), bias
    return add_adapter


def local_experts(mlp) -> Optional[List[Tuple[int, torch.nn.Module]]]:
    """A routed layer's experts on this rank as ``(global expert index, megatron-core MLP module)``
    (``MoELayer.local_expert_indices`` with ``SequentialMLP.local_experts``), None for a dense MLP."""
    experts = getattr(mlp, "experts", None)
    if experts is None or hasattr(mlp, "linear_fc1"):
        return None
    return list(zip(mlp.local_expert_indices, getattr(experts, "local_experts", None) or []))


def _attach(parent: torch.nn.Module, linear, target: str, adapter_name: str, settings: LoraSettings, seed: int,
            gated: bool, expert: bool = False) -> None:
    """One adapter on ``linear``, held by ``parent.adapter_layer[adapter_name]``, added by a forward hook.
    An expert's adapter is reduced over the expert-data-parallel group, as the expert's weights are."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    kind = TARGETS[target][3]
    if type(linear) not in (ColumnParallelLinear, RowParallelLinear):
        raise ConfigError(f"{_KEYS}.target_modules: {target} is a {type(linear).__name__} here; LoRA "
                          "needs megatron-core's local layer spec (model.force_local_spec=True)")
    weight = linear.weight
    in_features, out_features = _full_shape(linear, kind)
    if settings.variant == "canonical" and target in CANONICAL and not expert:
        adapter_name, names = CANONICAL[target]
        adapter = _unfused(linear, target, names, in_features, out_features, settings, seed, gated)
    else:
        adapter = LoraAdapter(in_features, out_features, kind, settings, seed=seed,
                              gated=gated and target == "mlp_fc1", dtype=weight.dtype, device=weight.device)
    holder = getattr(parent, "adapter_layer", None)
    if holder is None:
        holder = AdapterLayer()
        parent.adapter_layer = holder
    holder[adapter_name] = adapter
    if expert:
        for p in adapter.parameters():
            p.allreduce = False  # megatron-core's mark of an expert-parallel parameter (DDP, optimizer)
    linear.__dict__["lora_adapter"] = adapter  # not a sub-module: its weights live under adapter_layer
    linear.register_forward_hook(_hook(adapter))


def _unfused(linear, target: str, names: Tuple[str, ...], in_features: int, out_features: int,
             settings: LoraSettings, seed: int, gated: bool) -> UnfusedLoraAdapter:
    """The canonical variant's adapter for ``linear_qkv`` (query, key, value) or a gated ``linear_fc1``."""
    from megatron.core import parallel_state

    weight = linear.weight
    if target == "mlp_fc1":
        if not gated:
            raise ConfigError(f"{_KEYS}.variant=canonical with target mlp_fc1 splits fc1 into gate and up "
                              "adapters; this model's activation has no gate (use variant=nemo)")
        return UnfusedLoraAdapter(names, (out_features // 2,) * 2, in_features, settings, seed,
                                  dtype=weight.dtype, device=weight.device)
    config = linear.config
    groups = config.num_query_groups or config.num_attention_heads
    channels = config.kv_channels
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return UnfusedLoraAdapter(names, (config.num_attention_heads * channels, groups * channels, groups * channels),
                              in_features, settings, seed, groups=groups // tp, dtype=weight.dtype,
                              device=weight.device)


def add_lora_adapters(module: torch.nn.Module, settings: LoraSettings, seed: int, gated: bool) -> int:
    """Attach adapters to this pipeline stage's layers (``module.decoder.layers``); returns how many."""
    count = 0
    for layer in getattr(getattr(module, "decoder", None), "layers", []):
        number = int(layer.layer_number)  # 1-based, global over pipeline stages
        if settings.layers is not None and number not in settings.layers:
            continue
        for target in settings.targets:
            parent_name, linear_name, adapter_name, kind = TARGETS[target]
            parent = getattr(layer, parent_name)
            target_seed = seed * 1000003 + number * 16 + list(TARGETS).index(target)
            experts = local_experts(parent) if parent_name == "mlp" else None
            if experts is not None:
                if not experts:
                    raise ConfigError(f"{_KEYS}.target_modules: {target} on a mixture-of-experts layer (layer "
                                      f"{number}) needs its experts as separate MLPs (megatron-core's "
                                      "SequentialMLP); target the attention (attention_qkv, attention_dense)")
                for index, expert in experts:  # seeded by the global expert index: any EP size
                    _attach(expert, getattr(expert, linear_name), target, MOE_ADAPTERS[target], settings,
                            target_seed * 1009 + index + 1, gated, expert=True)
                    count += 1
                continue
            _attach(parent, getattr(parent, linear_name, None), target, adapter_name, settings, target_seed, gated)
            count += 1
    return count


def _full_shape(linear, kind: str) -> Tuple[int, int]:
    """A parallel linear layer's whole (input, output) sizes."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    out_local, in_local = linear.weight.shape
    return (in_local * tp, out_local) if kind == "row" else (in_local, out_local * tp)


def adapters(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Each adapted layer's adapter (a canonical adapter counts once, not per block)."""
    return (m for m in module.modules() if isinstance(m, UnfusedLoraAdapter)
            or (isinstance(m, LoraAdapter) and not getattr(m, "part_of_unfused", False)))


def effective_weight(linear) -> torch.Tensor:
    """A linear layer's weight with its (enabled) adapter merged in: a new tensor, the layer unchanged."""
    adapter = linear.__dict__.get("lora_adapter")
    if adapter is None or not adapter.enabled:
        return linear.weight
    return (linear.weight.float() + adapter.delta_weight()).to(linear.weight.dtype)


@contextmanager
def adapters_disabled(module: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter of ``module`` skipped for the duration."""
    found = list(adapters(module))
    states = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(found, states):
            a.enabled = state


@contextmanager
@torch.no_grad()
def merged_into_base(module: torch.nn.Module) -> Iterator[None]:
    """Each adapter's ``scale * B @ A`` added to its layer's weight (adapters off) for the duration; the
    layers' weights are restored exactly afterwards from a CPU copy."""
    linears = [m for m in module.modules() if m.__dict__.get("lora_adapter") is not None]
    saved = [m.weight.detach().to("cpu", copy=True) for m in linears]
    with adapters_disabled(module):
        for m in linears:
            m.weight.copy_((m.weight.float() + m.__dict__["lora_adapter"].delta_weight()).to(m.weight.dtype))
        try:
            yield
        finally:
            for m, w in zip(linears, saved):
                m.weight.copy_(w)


def freeze_all_but(module: torch.nn.Module, tags: Tuple[str, ...]) -> Dict[str, int]:
    """``requires_grad=False`` for every parameter whose name has none of ``tags``; returns
    ``{"trainable": n, "frozen": m}`` (element counts on this rank)."""
    counts = {"trainable": 0, "frozen": 0}
    for name, p in module.named_parameters():
        keep = any(tag in name for tag in tags)
        p.requires_grad_(keep)
        counts["trainable" if keep else "frozen"] += p.numel()
    return counts


# ----------------------------------------------------------------- NeMo's adapters-only .nemo
# NeMo's PEFT checkpoint holds, per model-parallel rank, a torch-saved dict of that rank's adapter
# tensors keyed ``model.decoder.layers.<layer index within the pipeline stage>.<...>.adapter_layer.<name>.
# linear_in|linear_out.weight``. Its tensor-parallel splits: ``linear_out`` always by rows; ``linear_in``
# by rows (the adapter dimension) on column-parallel layers and by columns on row-parallel ones.
def _nemo_dims(kind: str) -> Tuple[int, int]:
    """(linear_in's, linear_out's) split dimension in NeMo's PEFT files."""
    return (0, 0) if kind == "column" else (1, 0)


def _nemo_slots(layer) -> Iterator[Tuple[str, "LoraAdapter"]]:
    """``(key prefix within the layer in NeMo's PEFT files, adapter)`` for each of a layer's adapters."""
    for parent_name in ("self_attention", "mlp"):
        holder = getattr(getattr(layer, parent_name), "adapter_layer", None)
        for name, adapter in (holder or {}).items():
            if isinstance(adapter, UnfusedLoraAdapter):
                for part in adapter.names:
                    yield f"{parent_name}.adapter_layer.{name}.{part}.", getattr(adapter, part)
            else:
                yield f"{parent_name}.adapter_layer.{name}.", adapter
    for i, expert in local_experts(layer.mlp) or []:  # global indices: the files of a run without EP
        for name, adapter in (getattr(expert, "adapter_layer", None) or {}).items():
            yield f"mlp.experts.local_experts.{i}.adapter_layer.{name}.expert_adapters.{i}.", adapter


def nemo_adapter_state(module: torch.nn.Module, trained_extra: Tuple[str, ...] = ()) -> Dict[str, torch.Tensor]:
    """This rank's adapters in NeMo's PEFT layout (CPU tensors), plus the role's other trained
    parameters (``trained_extra`` name tags, e.g. a reward head) as this rank holds them; with expert
    parallelism, the adapters of every rank's experts (collective over the expert-parallel group)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for index, layer in enumerate(getattr(getattr(module, "decoder", None), "layers", [])):
        for path, adapter in _nemo_slots(layer):
            prefix = f"model.decoder.layers.{index}.{path}"
            a, b = adapter.linear_in.weight.detach(), adapter.linear_out.weight.detach()
            if adapter.kind == "column":
                if a.shape[0] % tp:
                    raise ConfigError(f"{_KEYS}.adapter_dim={a.shape[0]} is not divisible by the tensor-"
                                      f"parallel size {tp}: NeMo's adapter layout splits it")
                a = a.chunk(tp, dim=0)[rank]
            else:
                b = b.chunk(tp, dim=0)[rank]
            out[prefix + "linear_in.weight"] = a.to("cpu", copy=True)
            out[prefix + "linear_out.weight"] = b.to("cpu", copy=True)
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        # every rank's experts' adapters (collective over the expert-parallel group)
        import torch.distributed as dist

        mine = {k: v for k, v in out.items() if ".mlp.experts.local_experts." in k}
        gathered = [None] * parallel_state.get_expert_model_parallel_world_size()
        dist.all_gather_object(gathered, mine, group=parallel_state.get_expert_model_parallel_group())
        for part in gathered:
            out.update(part)
    for name, p in module.named_parameters():
        if p.requires_grad and ADAPTER_TAG not in f".{name}" and any(tag in name for tag in trained_extra):
            out[f"model.{name}"] = p.detach().to("cpu", copy=True)
    return out


def _whole(parts: List[torch.Tensor], dim: int, gated_rows: bool) -> torch.Tensor:
    if gated_rows and len(parts) > 1:  # each rank's rows are [its gate rows; its up rows]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(parts, dim=dim)


def _parts_by_global_key(rank_states: Dict[Tuple[int, int], dict], saved_tp: int, saved_pp: int,
                         num_layers: int) -> Dict[str, List[Optional[torch.Tensor]]]:
    """The per-rank files' tensors by key with global (0-based) layer numbers: each key's
    tensor-parallel parts in rank order (None where a rank's file lacks it)."""
    per_stage = num_layers // saved_pp
    found: Dict[str, List[Optional[torch.Tensor]]] = {}
    for pp_rank in range(saved_pp):
        for tp_rank in range(saved_tp):
            for key, value in rank_states[(tp_rank, pp_rank)].items():
                parts = key.split(".")
                if key.startswith("model.decoder.layers.") and len(parts) > 3 and parts[3].isdigit():
                    parts[3] = str(int(parts[3]) + per_stage * pp_rank)
                found.setdefault(".".join(parts), [None] * saved_tp)[tp_rank] = value
    return found


# NeMo's adapter names on column-parallel layers (dense, expert and canonical), and those whose B
# holds each rank's [gate; up] rows
_COLUMN_ADAPTERS = tuple(f".{name}." for _, _, name, kind in TARGETS.values() if kind == "column") + \
    (f".{MOE_ADAPTERS['mlp_fc1']}.",) + tuple(f".{name}." for name, _ in CANONICAL.values())
_GATED_ADAPTERS = (f".{TARGETS['mlp_fc1'][2]}.", f".{MOE_ADAPTERS['mlp_fc1']}.")


def join_nemo_adapter_files(rank_states: Dict[Tuple[int, int], dict], saved_tp: int, saved_pp: int,
                            num_layers: int, gated: bool, what: str) -> Dict[str, torch.Tensor]:
    """A PEFT checkpoint's adapter tensors whole (as one process at TP=1, PP=1 holds them), keyed with
    global layer numbers; ``gated``: the model's fc1 is gated (each rank's rows are its [gate; up])."""
    from nemo_aligner.utils.errors import CheckpointError

    out = {}
    for key, parts in _parts_by_global_key(rank_states, saved_tp, saved_pp, num_layers).items():
        if ADAPTER_TAG not in key or not key.endswith(("linear_in.weight", "linear_out.weight")):
            raise CheckpointError(f"{what}: {key} is not a LoRA adapter tensor (a trained head has no place in "
                                  "an adapters-only conversion)")
        if any(p is None for p in parts):
            raise CheckpointError(f"{what}: {key} is missing from a tensor-parallel rank's file")
        half_in = key.endswith("linear_in.weight")
        dims = _nemo_dims("column" if any(tag in key for tag in _COLUMN_ADAPTERS) else "row")
        gated_rows = gated and not half_in and any(tag in key for tag in _GATED_ADAPTERS)
        out[key] = _whole(parts, dims[0 if half_in else 1], gated_rows)
    return out


def _refuse_unplaced(found: Dict[str, list], layer, number: int, what: str) -> None:
    """A CheckpointError if the file holds an adapter of this layer that the model has no place for (it
    would be dropped silently: adapters trained with other ``lora_tuning`` settings)."""
    from nemo_aligner.utils.errors import CheckpointError

    placed = {f"model.decoder.layers.{number}.{path}{half}.weight" for path, _ in _nemo_slots(layer)
              for half in ("linear_in", "linear_out")}
    local = {str(i) for i, _ in local_experts(layer.mlp) or []}
    prefix = f"model.decoder.layers.{number}."
    for key in found:
        if not key.startswith(prefix) or ADAPTER_TAG not in key or key in placed:
            continue
        parts = key[len(prefix):].split(".")
        if parts[:2] == ["mlp", "experts"] and len(parts) > 3:
            entry = parts[parts.index("expert_adapters") + 1] if "expert_adapters" in parts[:-1] else parts[3]
            if parts[3] not in local or entry != parts[3]:
                continue  # another expert-parallel rank's expert, or an entry NeMo's per-expert list leaves unread
        raise CheckpointError(f"{what}: holds adapter {key}, which this model's model.peft.lora_tuning settings "
                              "(target_modules, layer_selection, variant) place nowhere; give the settings the "
                              "adapters were trained with")


def load_nemo_adapters(module: torch.nn.Module, rank_states: Dict[Tuple[int, int], dict], saved_tp: int,
                       saved_pp: int, num_layers: int, what: str) -> int:
    """Set this stage's adapters (and other trained tensors) from a PEFT checkpoint's per-rank dicts
    (``{(tp_rank, pp_rank): state}``, saved at ``saved_tp`` x ``saved_pp``); returns the tensors set."""
    from megatron.core import parallel_state

    from nemo_aligner.utils.errors import CheckpointError

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    found = _parts_by_global_key(rank_states, saved_tp, saved_pp, num_layers)
    count = 0
    with torch.no_grad():
        for layer in getattr(getattr(module, "decoder", None), "layers", []):
            number = int(layer.layer_number) - 1
            _refuse_unplaced(found, layer, number, what)
            for path, adapter in _nemo_slots(layer):
                prefix = f"model.decoder.layers.{number}.{path}"
                in_dim, out_dim = _nemo_dims(adapter.kind)
                for half, dim in (("linear_in", in_dim), ("linear_out", out_dim)):
                    parts = found.get(prefix + half + ".weight")
                    if parts is None or any(p is None for p in parts):
                        raise CheckpointError(f"{what}: has no adapter {prefix}{half}.weight; it was saved "
                                              "with other model.peft.lora_tuning settings (target_modules, "
                                              "layer_selection)")
                    gated_rows = adapter.gated and half == "linear_out"
                    full = _whole(parts, dim, gated_rows)
                    if half == "linear_in":
                        local = full if adapter.kind == "column" else full.chunk(tp, dim=1)[rank]
                    else:
                        local = _rows_of_rank(full, tp, rank, adapter.gated) if adapter.kind == "column" else full
                    target = getattr(adapter, half).weight
                    if tuple(local.shape) != tuple(target.shape):
                        raise CheckpointError(f"{what}: adapter {prefix}{half}.weight has shape "
                                              f"{list(full.shape)}, not what model.peft.lora_tuning and the "
                                              "model's sizes give (adapter_dim, hidden sizes)")
                    target.copy_(local)
                    count += 1
        for name, p in module.named_parameters():
            key = f"model.{name}"
            if not p.requires_grad or ADAPTER_TAG in f".{name}" or key not in found:
                continue
            parts = found[key]
            if getattr(p, "tensor_model_parallel", False) or (parts[0] is not None and parts[0].shape != p.shape):
                dim = getattr(p, "partition_dim", 0)
                full = torch.cat(parts, dim=dim)
                local = full.chunk(tp, dim=dim)[rank]
            else:
                local = parts[0]
            p.copy_(local)
            count += 1
    return count
