"""Expert-parallel ranks kept in step while each generates for its own prompts.

With ``model.expert_model_parallel_size > 1`` every MoE layer is a collective over its expert
group: each rank of the group must call it as many times as the others, and the tokens routed to a
rank's experts are computed with that rank's weights. Ranks that generate for their own prompts
break the first rule: one rank's rows reach EOS while another's decode on, and in a multi-turn
episode one rank may run more generation calls than another.

So every forward of a generation first joins a *round*: an all-reduce (MAX) over the expert group
of "I forward now". A rank whose generation is over *drains*: it joins rounds with 0 and, while any
rank of its group still forwards, calls its own MoE layers on one zero token (their output is
dropped), so the others' routed tokens still reach its experts. The drain ends at the first round
in which no rank forwards; every rank is then at the same point of the trainer's code.

Drains sit where that code is the same on every rank and what follows is not a generation
forward: at the start of each training or log-prob ``forward_backward`` (which also checks that
the ranks run equal numbers of micro-batches), on both sides of every weight swap
(:func:`swapped_weights`: a peer's tokens must meet the expert weights of the policy that
generates them) and where inference ends.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import torch
import torch.distributed as dist

from nemo_aligner.utils import weight_swap


def is_moe_layer(mlp) -> bool:
    """Whether a layer's MLP is a mixture of experts (megatron-core's ``MoELayer``: a router and
    experts instead of ``linear_fc1``/``linear_fc2``)."""
    return getattr(mlp, "router", None) is not None and not hasattr(mlp, "linear_fc1")


def moe_inference_call(mlp):
    """A routed MLP as ``x [S, B, H] -> [S, B, H]``, evaluated as at inference (no router jitter and
    no load-balancing loss) whatever the module's mode."""

    def call(x):
        training = mlp.training
        if training:
            mlp.train(False)
        try:
            # Outside inference mode: gloo fills a collective's output (the expert group's gathered
            # tokens) on its own thread, where an inference tensor cannot be written.
            with torch.inference_mode(False), torch.no_grad():
                out, bias = mlp(x)
        finally:
            if training:
                mlp.train(True)
        return out + bias if bias is not None else out

    return call


class ExpertLockstep:
    """Rounds and drains over this rank's expert-parallel group for one model (this pipeline stage's
    MoE layers)."""

    def __init__(self, module):
        from megatron.core import parallel_state

        from nemo_aligner.utils.distributed import comm_device

        self.group = parallel_state.get_expert_model_parallel_group()
        self.size = parallel_state.get_expert_model_parallel_world_size()
        self.moe = [moe_inference_call(layer.mlp) for layer in module.decoder.layers if is_moe_layer(layer.mlp)]
        param = next(module.parameters())
        self.token = torch.zeros(1, 1, module.config.hidden_size, dtype=param.dtype, device=param.device)
        self.device = comm_device()

    def _round(self, forwarding: bool, count: int) -> torch.Tensor:
        flags = torch.tensor([int(forwarding), count, -count], dtype=torch.long, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return flags.cpu()

    def before_forward(self) -> None:
        """Join a round as a rank about to run a generation forward."""
        self._round(True, 0)

    def drain(self, micro_batches: Optional[int] = None) -> None:
        """Idle MoE forwards until no rank of the group generates. ``micro_batches``: this rank's
        count for the ``forward_backward`` that follows, which must be every rank's."""
        count = int(micro_batches or 0)
        while True:
            flags = self._round(False, count)
            if int(flags[0]) == 0:
                break
            for call in self.moe:
                call(self.token)
        if int(flags[1]) != -int(flags[2]):
            raise RuntimeError(f"the ranks of model.expert_model_parallel_size={self.size} hold from {-int(flags[2])} "
                               f"to {int(flags[1])} micro-batches in one forward/backward pass; their MoE layers "
                               "need the same number on every rank")


def lockstep_for(module) -> Optional[ExpertLockstep]:
    """The model's ``ExpertLockstep`` with expert parallelism, else None."""
    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_expert_model_parallel_world_size() == 1:
        return None
    return ExpertLockstep(module)


def drain(module, micro_batches: Optional[int] = None) -> None:
    """``ExpertLockstep.drain`` where the model has expert parallelism; nothing otherwise."""
    lockstep = lockstep_for(module)
    if lockstep is not None:
        lockstep.drain(micro_batches)


@contextmanager
def swapped_weights(module, state: Dict[str, torch.Tensor], seconds: Optional[Dict[str, float]] = None) -> Iterator[None]:
    """``utils.weight_swap.swapped_weights`` with the expert group drained before the swap in and
    before the swap out (not when the body fails): expert-parallel peers still generating meet the
    expert weights of the policy they generate with."""
    drain(module)
    with weight_swap.swapped_weights(module, state, seconds):
        yield
        drain(module)
