"""Where this process sits in a job (rank, world size, rendezvous), read from the environment that
torchrun, Slurm or mpirun sets; without importing torch, so that scripts can decide whether to start
their own ranks, and refuse bad settings, before torch loads."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from nemo_aligner.utils.errors import ConfigError


@dataclass
class LaunchInfo:
    """Where this process sits in the job, read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm", "mpirun" or "single"
    local_world_size: int = 1  # processes on this node, where the launcher says (else local_rank + 1)


def first_host_of_nodelist(nodelist: str) -> str:
    """First host of a Slurm node list such as ``node[003-005,007],gpu12``.

    Does the part of ``scontrol show hostnames`` we need without calling it.
    """
    nodelist = nodelist.strip()
    match = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        raise ConfigError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def read_launch_info(environ=None) -> LaunchInfo:
    """Read rank and rendezvous from torchrun (``RANK``...), Slurm (``SLURM_PROCID``...) or MPI
    (``OMPI_COMM_WORLD_RANK``..., ``PMI_RANK``...) variables."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 0) or int(env.get("LOCAL_RANK", 0)) + 1),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        # The step's own nodes: in a heterogeneous job the job's list is another component's too.
        nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                    or "127.0.0.1")
        # Both components of a heterogeneous job see the leader's SLURM_JOB_ID; each srun is its
        # own step, so the step id keeps the critic's and the actor's rendezvous ports apart.
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        step_id = int(env.get("SLURM_STEP_ID", "0") or 0)
        return LaunchInfo(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or first_host_of_nodelist(nodelist),
            master_port=int(env.get("MASTER_PORT") or 20000 + (job_id % 2000) * 10 + step_id % 10),
            launcher="slurm",
            local_world_size=_slurm_tasks_on_node(env),
        )
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return _mpi_launch_info(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                "OMPI_COMM_WORLD_LOCAL_SIZE")
    if "PMI_RANK" in env and "PMI_SIZE" in env and int(env["PMI_SIZE"]) > 1:  # MPICH / Intel MPI (hydra)
        return _mpi_launch_info(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    return LaunchInfo(0, 1, 0, "127.0.0.1", 0, "single")


# Set the same in every rank of one mpirun, different between two mpiruns (Open MPI 4 / 5, MPICH).
_MPI_JOB_KEYS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri", "PMI_KVS_NAME", "PMI_FD")


def _mpi_launch_info(env, rank_key: str, size_key: str, local_rank_key: str, local_size_key: str) -> LaunchInfo:
    """Rank and rendezvous under ``mpirun``: MPI's rank variables; ``MASTER_ADDR``/``MASTER_PORT`` when
    exported (``mpirun -x MASTER_ADDR=...``), else 127.0.0.1 on one node and a port derived from the
    MPI job's id, which every rank of the job sees alike."""
    import zlib

    world = int(env[size_key])
    local_rank = int(env.get(local_rank_key, 0) or 0)
    local_size = int(env.get(local_size_key, 0) or 0) or local_rank + 1
    master_addr = env.get("MASTER_ADDR")
    if not master_addr:
        if local_size < world:
            raise ConfigError(f"mpirun started {world} ranks on several nodes: export MASTER_ADDR (the host of rank 0) "
                              f"to every rank, e.g. `mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port> ...`")
        master_addr = "127.0.0.1"
    port = env.get("MASTER_PORT")
    if not port:
        job = next((env[key] for key in _MPI_JOB_KEYS if env.get(key)), "")
        port = 20000 + zlib.crc32(job.encode()) % 12000
    return LaunchInfo(rank=int(env[rank_key]), world_size=world, local_rank=local_rank, master_addr=master_addr,
                      master_port=int(port), launcher="mpirun", local_world_size=local_size)


def _slurm_tasks_on_node(env) -> int:
    """Tasks on this node: ``SLURM_NTASKS_PER_NODE``, else the first count of ``SLURM_TASKS_PER_NODE``
    (``2(x3),1``), else this task's local id + 1."""
    local = int(env.get("SLURM_LOCALID", 0)) + 1
    for key in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        match = re.match(r"^(\d+)", env.get(key, ""))
        if match:
            return max(int(match.group(1)), local)
    return local
