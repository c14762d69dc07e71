"""Rank 0 writes every listening inet socket of the job's processes (the supervising one, if any,
and all ranks), and which process listens on MASTER_PORT, to ``argv[1]`` as JSON, while all ranks
are alive. Without RANK in the environment
this process starts 2 ranks itself, as ``trainer.devices=2`` does (``argv[2] == "env"``: as an
external launcher does, only RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT telling each its place)."""

import json
import os
import sys

import psutil

from nemo_aligner.utils.distributed import barrier, init_distributed


def main():
    if "RANK" not in os.environ and sys.argv[2:] == ["env"]:
        import subprocess

        from nemo_aligner.utils.ports import free_port

        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, *sys.argv], env=dict(
            os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port)) for r in range(2)]
        sys.exit(max(p.wait() for p in procs))
    if "RANK" not in os.environ:
        from nemo_aligner.utils.self_launch import spawn_ranks

        sys.exit(spawn_ranks(2))
    info = init_distributed()
    barrier()
    if info.rank == 0:
        root = psutil.Process(int(os.environ.get("JOB_ROOT_PID") or os.getppid()))
        processes = [root, *root.children(recursive=True)]
        listeners = {(c.laddr.ip, c.laddr.port): p.pid for p in processes for c in p.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        master = [pid for (_, port), pid in listeners.items() if port == int(os.environ["MASTER_PORT"])]
        with open(sys.argv[1], "w") as out:
            json.dump({"processes": len(processes), "listening": sorted(listeners),
                       "master_port_listener": ("supervisor" if master == [root.pid] else
                                                "rank 0" if master == [os.getpid()] else master)}, out)
    barrier()


if __name__ == "__main__":
    main()
