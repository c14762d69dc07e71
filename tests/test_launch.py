"""Starting ranks: ``trainer.devices=N`` by hand (the script starts them), torchrun, mpirun; Hydra's
``--config-path``/``--config-name`` before the overrides."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import SCRIPTS, TINY_ARCH, run_python, subprocess_env, tiny_batch, train_losses
from nemo_aligner.utils.distributed import check_world_size
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.launch_info import read_launch_info
from nemo_aligner.utils.hydra_runner import split_hydra_flags
from nemo_aligner.utils.self_launch import ranks_to_start

SFT = os.path.join(SCRIPTS, "train_gpt_sft.py")
CONF = os.path.join(SCRIPTS, "conf")


def test_hydra_flags_split_from_overrides():
    args = ["--config-path=/c", "--config-name", "gpt_sft", "a.b=1", "++c=2", "-cn", "x", "--cfg", "job",
            "~d", "--info", "e.f=3", "--help"]
    flags, overrides = split_hydra_flags(args)
    assert flags == ["--config-path=/c", "--config-name", "gpt_sft", "-cn", "x", "--cfg", "job", "--info", "--help"]
    assert overrides == ["a.b=1", "++c=2", "~d", "e.f=3"]


def test_ranks_to_start():
    assert ranks_to_start(1, 1) == 1
    assert ranks_to_start(4, 1) == 4
    assert ranks_to_start(None, None) == 1
    assert ranks_to_start(-1, 1, gpus=8) == 8
    assert ranks_to_start("auto", 1, gpus=0) == 1
    with pytest.raises(ConfigError, match=r"trainer.num_nodes=2: start the ranks on every node with srun"):
        ranks_to_start(4, 2)
    with pytest.raises(ConfigError, match=r"trainer.devices=0 must be a positive integer, -1 or auto"):
        ranks_to_start(0, 1)
    with pytest.raises(ConfigError, match=r"trainer.num_nodes='two' must be a positive integer"):
        ranks_to_start(2, "two")


def test_mpi_launch_info():
    base = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1620770817"}
    info = read_launch_info(base)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.launcher) == (1, 2, 1, 2, "mpirun")
    assert info.master_addr == "127.0.0.1"
    # Every rank of one job derives the same port; another job a different one.
    rank0 = read_launch_info({**base, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    other = read_launch_info({**base, "OMPI_MCA_ess_base_jobid": "1620770999"})
    assert rank0.master_port == info.master_port != other.master_port
    assert 20000 <= info.master_port < 32000
    exported = read_launch_info({**base, "MASTER_ADDR": "node7", "MASTER_PORT": "4321"})
    assert (exported.master_addr, exported.master_port) == ("node7", 4321)
    with pytest.raises(ConfigError, match="export MASTER_ADDR"):
        read_launch_info({**base, "OMPI_COMM_WORLD_SIZE": "4"})  # 2 of 4 ranks here: several nodes
    mpich = read_launch_info({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4",
                              "PMI_KVS_NAME": "kvs_1"})
    assert (mpich.rank, mpich.world_size, mpich.local_rank, mpich.launcher) == (3, 4, 3, "mpirun")
    # torchrun's variables win over MPI's (torchrun inside an mpirun allocation).
    assert read_launch_info({**base, "RANK": "0", "WORLD_SIZE": "1"}).launcher == "torchrun"


def test_world_size_message_never_advises_zero_devices():
    with pytest.raises(ConfigError) as err:
        check_world_size(1, 8, 2)
    assert "trainer.devices=0" not in str(err.value)
    assert "their product is 1" in str(err.value)


def _sft_args(builtin_data, log_dir, extra=()):
    arch = [f"model.{k}={v}" for k, v in TINY_ARCH.items() if v is not None]
    return [*arch, "model.encoder_seq_length=32", f"model.data.train_ds.file_path={builtin_data['sft_train']}",
            f"model.data.validation_ds.file_path={builtin_data['sft_val']}", "model.data.train_ds.micro_batch_size=2",
            "model.data.train_ds.global_batch_size=8", "model.data.validation_ds.micro_batch_size=2",
            "model.data.validation_ds.global_batch_size=8", "trainer.sft.max_steps=3",
            "trainer.sft.val_check_interval=3", "trainer.sft.limit_val_batches=1",
            f"exp_manager.explicit_log_dir={log_dir}", *extra]


def _run_ranks_by_env(env_for_rank, nproc, args, timeout=300):
    """Start ``nproc`` copies of the SFT script the way an external launcher does: only environment
    variables tell each its rank."""
    procs = []
    for rank in range(nproc):
        env = subprocess_env(nproc)
        env.update(env_for_rank(rank))
        procs.append(subprocess.Popen([sys.executable, SFT, *tiny_batch(SFT), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, f"rank failed ({p.returncode}):\n{out[-3000:]}\n{err[-4000:]}"


@pytest.mark.stack
def test_devices_start_ranks_like_torchrun_and_mpirun(tmp_path, builtin_data):
    """``trainer.devices=2`` run by hand starts 2 ranks; TP=2 training equals the same run under
    torchrun and under mpirun's variables, step for step."""
    tp = ["trainer.devices=2", "model.tensor_model_parallel_size=2"]
    by_hand = run_python(SFT, _sft_args(builtin_data, tmp_path / "hand", tp), like_nproc=2)
    assert "world size 2: tensor parallel 2" in by_hand.stderr + by_hand.stdout
    assert os.path.isfile(tmp_path / "hand" / "checkpoints" / "megatron_gpt_sft.nemo")
    run_python(SFT, _sft_args(builtin_data, tmp_path / "torchrun", tp), nproc=2)
    job = "424242"
    _run_ranks_by_env(lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                                 "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                 "OMPI_MCA_ess_base_jobid": job}, 2, _sft_args(builtin_data, tmp_path / "mpi", tp))
    hand, torchrun, mpi = (train_losses(str(tmp_path / d)) for d in ("hand", "torchrun", "mpi"))
    assert sorted(hand) == [1, 2, 3]
    assert hand == torchrun == mpi


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun (CI installs it: .ci/run)")
def test_real_mpirun_with_config_path_first(tmp_path, builtin_data):
    """NeMo-Aligner's CI form: ``mpirun -np 2 python train.py --config-path=... --config-name=... ...``."""
    cmd = ["mpirun", "-np", "2", "--oversubscribe", sys.executable, "-u", SFT, f"--config-path={CONF}",
           "--config-name=gpt_sft", "trainer.num_nodes=1", *tiny_batch(SFT), *_sft_args(builtin_data, tmp_path / "mpi",
                                                                      ["trainer.devices=2"])]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    proc = subprocess.run(cmd, env=subprocess_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "data parallel 2" in proc.stdout + proc.stderr
    assert sorted(train_losses(str(tmp_path / "mpi"))) == [1, 2, 3]


@pytest.mark.parametrize("how", ["devices", "env"])
def test_every_socket_of_a_one_machine_job_listens_on_loopback_only(tmp_path, how):
    """torch's rendezvous store listens on every interface by default; here the elastic agent's store
    (``trainer.devices=2``) and rank 0's (an external launcher's variables), and gloo, listen on 127.0.0.1."""
    import json

    out = tmp_path / "listening.json"
    worker = os.path.join(os.path.dirname(__file__), "workers", "listening_sockets.py")
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.run([sys.executable, worker, str(out), *(["env"] if how == "env" else [])],
                          env=dict(subprocess_env(2), TMPDIR=str(temp)), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert os.listdir(temp) == []  # the elastic agent's log directories are gone with the job
    seen = json.loads(out.read_text())
    assert seen["processes"] == 3 and seen["listening"], seen  # the supervisor and both ranks; a store listens
    assert all(ip == "127.0.0.1" for ip, _ in seen["listening"]), seen
    # trainer.devices=2: the ranks' store is the agent's, listening before any rank starts (a port
    # chosen, released and bound again by rank 0 may be taken in between by another process)
    assert seen["master_port_listener"] == ("supervisor" if how == "devices" else "rank 0"), seen


def test_started_ranks_report_an_error_once_and_exit_1(tmp_path, builtin_data):
    args = _sft_args(builtin_data, tmp_path / "bad", ["trainer.devices=2"])
    args = [a for a in args if not a.startswith("model.data.train_ds.file_path")]
    missing = tmp_path / "missing.jsonl"
    proc = run_python(SFT, [*args, f"model.data.train_ds.file_path={missing}"], check=False, like_nproc=2)
    assert proc.returncode == 1
    assert f"error: {missing}: file does not exist" in proc.stderr
    # rank 0's line once; others are prefixed "[rank N]". Searched in the whole stream, not per line: a
    # library's C++ log line from the other rank can be cut by ours.
    prefixes = re.findall(r"(\[rank \d+\] )?error: " + re.escape(f"{missing}: file does not exist"), proc.stderr)
    assert prefixes.count("") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_devices_start_the_ranks_with_python_exec(tmp_path, builtin_data):
    """``PYTHON_EXEC`` names the ranks' interpreter, as under torchrun: each started rank runs it."""
    calls = tmp_path / "calls"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    args = _sft_args(builtin_data, tmp_path / "run", ["trainer.devices=2", "trainer.sft.max_steps=1"])
    env = dict(subprocess_env(2), PYTHON_EXEC=str(wrapper))
    proc = subprocess.run([sys.executable, SFT, *tiny_batch(SFT), *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and all(SFT in line for line in lines), lines


def test_config_path_and_name_before_overrides(tmp_path, builtin_data):
    args = [a for a in _sft_args(builtin_data, tmp_path / "cp") if not a.startswith("trainer.sft.max_steps")]
    proc = run_python(SFT, [f"--config-path={CONF}", "--config-name", "gpt_sft", *args, "trainer.sft.max_steps=1"])
    assert sorted(train_losses(str(tmp_path / "cp"))) == [1]
    assert proc.returncode == 0


def test_slurm_heterogeneous_components_get_their_own_rendezvous():
    """In a heterogeneous job both components see the leader's SLURM_JOB_ID and the job's node list
    of their own component; each srun is a step of its own (values as Slurm 22.05 sets them)."""
    common = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "1234",
              "SLURM_NTASKS_PER_NODE": "2"}
    critic = read_launch_info({**common, "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]",
                               "SLURM_JOB_NODELIST": "node[1-2]"})
    actor = read_launch_info({**common, "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "node[3-4]",
                              "SLURM_JOB_NODELIST": "node[1-2]"})
    assert (critic.master_addr, actor.master_addr) == ("node1", "node3")
    assert critic.master_port != actor.master_port and 20000 <= critic.master_port < 40000
    assert read_launch_info({**common, "SLURM_STEP_ID": "1", "MASTER_PORT": "29511"}).master_port == 29511


def test_nemo_extraction_knows_the_local_rank_under_mpirun(monkeypatch):
    """Only local rank 0 extracts a .nemo for its node; mpirun sets no LOCAL_RANK, so rank 1 took
    itself for rank 0 and the two raced on one directory."""
    from nemo_aligner.utils.nemo_file import _local_rank

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert _local_rank() == 1


@pytest.mark.stack
@pytest.mark.parametrize("form", ["addr_port", "bootstrap_info"])
def test_agent_shared_store_listens_on_its_address_only(form):
    """The store the elastic agent shares with its ranks, in both call forms torch has used."""
    import socket
    from types import SimpleNamespace

    import psutil
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from nemo_aligner.utils.patches.rendezvous_store import stores_bound_to_their_host

    with stores_bound_to_their_host() as shared:
        assert shared
        args = ("127.0.0.1", 0) if form == "addr_port" else (SimpleNamespace(master_addr="127.0.0.1", master_port=0),)
        store = DynamicRendezvousHandler._create_tcp_store_server(None, *args)
    assert store.port > 0
    mine = [c.laddr for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert [a.ip for a in mine] == ["127.0.0.1"], mine
    store.set("k", "v")
    client = __import__("torch").distributed.TCPStore("127.0.0.1", store.port, is_master=False)
    assert client.get("k") == b"v"
    with pytest.raises(OSError):  # still bound: nobody else can take the port
        socket.create_server(("127.0.0.1", store.port))
    assert DynamicRendezvousHandler._create_tcp_store_server.__name__ == "_create_tcp_store_server"


def test_ranks_that_tp_x_pp_cannot_divide_are_refused_before_any_starts(monkeypatch):
    """``trainer.devices=2`` with TP=2 x PP=2: one error in the supervising process, no ranks started
    (each rank used to load the model and print the same error)."""
    from omegaconf import OmegaConf

    from nemo_aligner.utils import self_launch

    monkeypatch.setattr(self_launch, "launched_by_a_launcher", lambda: False)
    started = []
    monkeypatch.setattr(self_launch, "spawn_ranks", lambda nproc, argv=None: started.append(nproc) or 0)
    trainer = OmegaConf.create({"devices": 2, "num_nodes": 1})
    model = OmegaConf.create({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"^trainer.devices=2 \(2 ranks\) is not divisible by "
                                          r"model.tensor_model_parallel_size=2 x model.pipeline_model_parallel_size=2$"):
        self_launch.maybe_spawn(trainer, ["train.py"], model_cfg=model)
    assert started == []
    OmegaConf.update(model, "pipeline_model_parallel_size", 1)
    assert self_launch.maybe_spawn(trainer, ["train.py"], model_cfg=model) == 0 and started == [2]
