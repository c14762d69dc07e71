"""Process-group start-up (torchrun or Slurm), megatron-core parallel state, and small collectives."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.launch_info import LaunchInfo, read_launch_info
from nemo_aligner.utils.patches.rendezvous_store import is_loopback, listening_store
from nemo_aligner.utils.ports import free_port

logger = logging.getLogger(__name__)

# This rank's GPU once NCCL is started (see comm_device); None: the CPU, or not started by us.
_comm_device: Optional[torch.device] = None


def check_gpus_per_node(info: LaunchInfo, gpus: int) -> None:
    """Each process on a node needs a GPU of its own (NCCL refuses two ranks on one device)."""
    needed = max(info.local_world_size, info.local_rank + 1)
    if gpus and needed > gpus:
        raise ConfigError(
            f"{needed} processes on this node but {gpus} GPU(s) visible: NCCL needs one GPU per process. "
            f"Launch at most {gpus} per node (torchrun --nproc_per_node {gpus}, trainer.devices={gpus}), or "
            f"hide the GPUs (CUDA_VISIBLE_DEVICES= , empty) to run every process on the CPU with gloo"
        )


def check_world_size(world_size: int, devices: int, num_nodes: int) -> None:
    """``trainer.devices`` x ``trainer.num_nodes`` must equal the number of launched processes."""
    if devices is None or devices in (-1, "auto"):
        return
    expected = int(devices) * int(num_nodes or 1)
    if expected != world_size:
        nodes = max(int(num_nodes or 1), 1)
        hint = (f"set trainer.devices={world_size // nodes}" if world_size % nodes == 0 and world_size >= nodes
                else f"set trainer.num_nodes and trainer.devices so that their product is {world_size}")
        raise ConfigError(
            f"trainer.devices={devices} x trainer.num_nodes={num_nodes} = {expected} processes, "
            f"but the launcher started {world_size}; {hint}, or start {expected} "
            f"(`torchrun --nproc_per_node {devices}` per node, or run the script without a launcher on one node: "
            f"it starts trainer.devices ranks itself)"
        )


def check_divisible(world_size: int, tp: int, pp: int, what: Optional[str] = None) -> None:
    """The world size must be a multiple of TP x PP (the model-parallel group size); ``what`` names
    where the world size comes from (default: "world size N")."""
    if tp < 1 or pp < 1:
        raise ConfigError("model.tensor_model_parallel_size and model.pipeline_model_parallel_size must be >= 1")
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"{what or f'world size {world_size}'} is not divisible by model.tensor_model_parallel_size={tp} x "
            f"model.pipeline_model_parallel_size={pp}"
        )


def check_parallel_sizes(world_size: int, tp: int, pp: int, num_attention_heads: int,
                         num_query_groups: Optional[int], num_layers: int) -> int:
    """Validate TP/PP against the world size and the model; returns the data-parallel size."""
    check_divisible(world_size, tp, pp)
    if num_attention_heads % tp != 0:
        raise ConfigError(
            f"model.tensor_model_parallel_size={tp} does not divide model.num_attention_heads={num_attention_heads}"
        )
    groups = num_query_groups or num_attention_heads
    if groups % tp != 0:
        raise ConfigError(f"model.tensor_model_parallel_size={tp} does not divide model.num_query_groups={groups}")
    if num_layers % pp != 0:
        raise ConfigError(
            f"model.pipeline_model_parallel_size={pp} does not divide model.num_layers={num_layers}"
        )
    return world_size // (tp * pp)


def check_expert_parallel_size(ep: int, dp: int, num_experts: Optional[int]) -> None:
    """Expert parallelism splits each MoE layer's experts over ``ep`` of the data-parallel ranks."""
    if ep == 1:
        return
    if not num_experts:
        raise ConfigError(f"model.expert_model_parallel_size={ep} needs a mixture-of-experts model "
                          "(model.num_moe_experts)")
    if dp % ep != 0:
        raise ConfigError(f"model.expert_model_parallel_size={ep} does not divide the data-parallel size {dp} "
                          "(world size / (tensor x pipeline parallel sizes)): the experts are split over "
                          "data-parallel ranks")
    if isinstance(num_experts, int) and num_experts % ep != 0:  # other values: refused when the model is built
        raise ConfigError(f"model.expert_model_parallel_size={ep} does not divide model.num_moe_experts={num_experts}")


def init_distributed(devices=None, num_nodes=1, timeout_minutes: int = 30) -> LaunchInfo:
    """Start ``torch.distributed`` (gloo on CPU, nccl on GPU) once per process."""
    info = read_launch_info()
    check_world_size(info.world_size, devices, num_nodes)
    if dist.is_initialized():
        return info
    if info.launcher == "single":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port(bound_at_once=True))
        info.master_port = int(os.environ["MASTER_PORT"])
    else:
        os.environ.setdefault("MASTER_ADDR", info.master_addr)
        os.environ.setdefault("MASTER_PORT", str(info.master_port))
    global _comm_device
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        check_gpus_per_node(info, torch.cuda.device_count())
        _comm_device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(_comm_device)
    from datetime import timedelta

    backend = "nccl" if use_cuda else "gloo"
    if info.launcher == "single":
        # One process: an in-memory store, so no rendezvous port listens (torch's TCPStore binds
        # every interface), and gloo on the loopback interface.
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(minutes=timeout_minutes))
        return info
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # Each rank decides alone; every rank takes the same rendezvous path below whatever it decides.
    all_here, loopback = info.local_world_size == info.world_size, is_loopback(addr)
    if all_here and loopback and sys.platform.startswith("linux"):
        # every rank on this machine: gloo's and NCCL's bootstrap sockets on the loopback interface too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = timedelta(minutes=timeout_minutes)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # the launcher's agent hosts the store (torchrun); every rank is its client
        dist.init_process_group(backend=backend, init_method=f"tcp://{addr}:{port}", rank=info.rank,
                                world_size=info.world_size, timeout=timeout)
        return info
    if info.rank != 0:
        store = dist.TCPStore(addr, port, info.world_size, is_master=False, timeout=timeout)
    elif loopback and not all_here:
        # ranks elsewhere may reach this node under the name that resolves to loopback here (Debian's
        # 127.0.1.1 for the host name): torch's store, listening on every interface
        store = dist.TCPStore(addr, port, info.world_size, is_master=True, timeout=timeout)
    else:
        store = listening_store(addr, port, info.world_size, timeout, what="MASTER_ADDR:MASTER_PORT")
    dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout)
    return info


def initialize_model_parallel(tp: int, pp: int, seed: int = 1234, ep: int = 1) -> None:
    """megatron-core parallel state (``ep``: expert parallelism, carved from the data-parallel ranks)
    plus seeded RNG trackers (CPU patches applied first)."""
    from megatron.core import parallel_state

    from nemo_aligner.utils import patches

    patches.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (the same on every TP rank, offset per PP stage) and the trackers."""
    import random

    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % (2**32))
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed, force_reset_rng=True)


def destroy() -> None:
    """Tear down megatron-core parallel state and the process group (tests, API)."""
    global _comm_device
    from megatron.core import parallel_state

    _comm_device = None

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_global_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def first_error_of_any_rank(error: Optional[str]) -> Optional[str]:
    """This rank's error, else the first error another rank met (a collective over every rank:
    it also stands for a barrier); None when no rank met one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return error or next((e for e in errors if e), None)


def broadcast_object(obj, src: int = 0):
    """Broadcast one picklable object from global rank ``src``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def comm_device() -> torch.device:
    """Where tensors handed to collectives must live: this rank's GPU under NCCL, else the CPU.

    Stored when the process group starts, because the CUDA current device is per thread (PyTriton
    answers requests on its own threads)."""
    if _comm_device is not None:
        return _comm_device
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_all_reduce(values: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """All-reduce ``values`` (metrics, counts: kept on the host) over ``group`` through the
    collective's device; returns the result on ``values``' device (``values`` itself is updated
    in place when it already lives there, as on the CPU)."""
    on_comm = values.to(comm_device())
    dist.all_reduce(on_comm, op=op, group=group)
    return on_comm.to(values.device)


def broadcast_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """Send a tensor computed on the last pipeline stage to every stage (metrics, logits)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    group = parallel_state.get_pipeline_model_parallel_group()
    on_comm = values.to(comm_device()).contiguous()
    dist.broadcast(on_comm, src=src, group=group)
    return on_comm.to(values.device)  # each stage gets it where it passed it
