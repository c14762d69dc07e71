"""Shared test helpers: built-in data, running scripts with python or torchrun, tiny model shapes."""

import json
import os
import re
import subprocess
import sys

import pytest

from nemo_aligner.demo import tiny_batch, tiny_optim  # noqa: F401 (the tests' tiny-model settings)
from nemo_aligner.utils.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "examples", "nlp", "gpt")
WORKERS = os.path.join(REPO, "tests", "workers")

# A 2-layer model small enough for 2 CPU cores; Llama-shaped (RoPE, RMSNorm, SwiGLU, untied, GQA).
TINY_ARCH = {
    "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
    "max_position_embeddings": 32, "position_embedding_type": "rope", "normalization": "rmsnorm",
    "activation": "swiglu", "bias": False, "share_embeddings_and_output_weights": False,
}
# GPT-2-shaped: learned positions, LayerNorm, GeLU, biases, tied embeddings.
TINY_GPT2_ARCH = {
    "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
    "max_position_embeddings": 32, "position_embedding_type": "learned_absolute", "normalization": "layernorm",
    "activation": "gelu", "bias": True, "share_embeddings_and_output_weights": True,
}


# The longest test files of each suite run first (measured per-file totals, longest first; the
# suite is the -m expression of `make test` or `make test-learning`). With --dist loadfile
# --no-loadscope-reorder (the Makefile) pytest-xdist hands a worker a whole file at a time in
# collection order; by default it orders files by their number of tests, which put the one-test
# critic-server file (~90 s) last and left the other worker idle meanwhile.
LONG_FILES_FIRST = {
    "not learning": (
        "test_reward_server.py", "test_reliability.py", "test_lora.py", "test_sft.py", "test_critic_server.py",
        "test_ppo.py", "test_aligner_commands.py", "test_launch.py", "test_cai.py", "test_api.py",
        "test_expert_lockstep.py", "test_nemo_formats.py", "test_knowledge_distillation.py", "test_spin.py",
        "test_steerlm.py", "test_precision.py", "test_reward_model.py", "test_generation.py", "test_bad_input.py",
        "test_dpo.py", "test_rs.py"),
    "learning": (
        "test_grpo.py", "test_ppo.py", "test_steerlm2.py", "test_api.py", "test_reinforce.py", "test_rs.py",
        "test_spin.py", "test_sft.py", "test_dpo.py", "test_kto.py", "test_knowledge_distillation.py",
        "test_reward_model.py"),
}


def pytest_collection_modifyitems(config, items):
    order = LONG_FILES_FIRST.get(config.getoption("markexpr") or "", LONG_FILES_FIRST["not learning"])
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def subprocess_env(nproc: int = 1, like_nproc: int = None, cpu_only: bool = False) -> dict:
    """The environment for a test's child processes; ``nproc`` processes on this node. They run on
    the device kind a run of ``like_nproc`` processes gets (a one-process reference compared with a
    two-process run: same kind, same numerics), or on the CPU with ``cpu_only``."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["WANDB_MODE"] = "offline"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    import torch

    gpus = torch.cuda.device_count()
    if cpu_only or 0 < gpus < max(nproc, like_nproc or 0):
        env["CUDA_VISIBLE_DEVICES"] = ""  # NCCL needs a GPU per process: such a run takes the CPU (gloo) path
    return env


def failure_excerpt(text: str, tail: int = 4000) -> str:
    """What to show of a failed run's output: its error-like lines from before the tail (each rank's
    ``error:`` line, exception lines, torchrun's per-rank summary), then the last ``tail`` characters.
    At several ranks the rank that failed first is often not the one whose traceback ends the log."""
    before = [line for line in text[:-tail].splitlines()
              if re.search(r"error|exception|traceback|exitcode|signal", line, re.IGNORECASE)]
    head = "[error-like lines before the tail]\n" + "\n".join(before[:60]) + "\n[tail]\n" if before else ""
    return head + text[-tail:]


ZYGOTE_DIR = os.path.join(REPO, "tests", "zygote")
_zygote = {}  # this pytest process's pre-imported interpreter: "socket", "proc"


def zygote_env(env: dict) -> tuple:
    """``(python, env)`` for a script run through this process's pre-imported interpreter
    (``tests/zygote/``; torchrun's ranks too, through ``PYTHON_EXEC``), or the real interpreter where
    there is none (``NEMO_ALIGNER_TEST_ZYGOTE=0`` turns it off)."""
    if not _zygote.get("socket"):
        return sys.executable, env
    shim = os.path.join(ZYGOTE_DIR, "python")
    env = dict(env, NEMO_ALIGNER_TEST_ZYGOTE=_zygote["socket"], ZYGOTE_REAL_PYTHON=sys.executable, PYTHON_EXEC=shim)
    return shim, env


def start_zygote() -> None:
    """Start the pre-imported interpreter that forks this process's script runs (``run_python``)."""
    import tempfile
    import time

    if os.environ.get("NEMO_ALIGNER_TEST_ZYGOTE") == "0" or sys.platform != "linux":
        return
    # a Unix socket's path has at most 107 bytes: /tmp rather than a long TMPDIR
    folder = _zygote["folder"] = tempfile.mkdtemp(prefix="zygote_", dir="/tmp" if os.path.isdir("/tmp") else None)
    path = os.path.join(folder, "sock")
    env = subprocess_env()
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # each run sets its own threads; the default is torch's
        env.pop(key, None)
        if key in os.environ:
            env[key] = os.environ[key]
    with open(os.path.join(folder, "log"), "w+") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ZYGOTE_DIR, "server.py"), path], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not os.path.exists(path):
            time.sleep(0.05)
        if proc.poll() is not None or not os.path.exists(path):
            stop_process(proc)
            log.seek(0)
            lines = log.read().strip().splitlines()
            _zygote["why_not"] = lines[-1] if lines else f"exit status {proc.returncode}"
            return
    _zygote.update(socket=path, proc=proc)


def stop_process(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session", autouse=True)
def zygote():
    """The pre-imported interpreter for this pytest process's script runs, stopped at the end."""
    import shutil

    start_zygote()
    yield _zygote.get("socket")
    if _zygote.get("proc") is not None:
        stop_process(_zygote["proc"])
    if _zygote.get("folder"):
        shutil.rmtree(_zygote["folder"], ignore_errors=True)
    _zygote.clear()


def run_python(path: str, args, nproc: int = 1, timeout: int = 300, check: bool = True, cwd=None,
               like_nproc: int = None, cpu_only: bool = False):
    """Run a script alone or under torchrun with ``nproc`` processes; returns the CompletedProcess.
    ``like_nproc``, ``cpu_only``: its device kind (``subprocess_env``). The built-in tiny model's batch
    sizes (``tiny_batch``, as the demo's) go before ``args``, which override them. The run starts
    from the pre-imported interpreter (``zygote_env``) where there is one."""
    import tempfile

    args = tiny_batch(path) + list(args)
    python, env = zygote_env(subprocess_env(nproc, like_nproc, cpu_only))
    # torchrun's per-run log directory (empty without --redirects) goes with the run, not to /tmp
    with tempfile.TemporaryDirectory(prefix="torchrun_logs_") as logs:
        if nproc > 1:
            cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", f"--log-dir={logs}", path]
        else:
            cmd = [python, path]
        cmd += [str(a) for a in args]
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        shown = " ".join([sys.executable, *cmd[1:]])  # the command as python runs it by hand
        raise AssertionError(f"{shown} failed ({proc.returncode}):\n{failure_excerpt(proc.stdout)}\n"
                             f"{failure_excerpt(proc.stderr, 6000)}")
    return proc


def run_as_slurm_tasks(path: str, args, ntasks: int = 2, timeout: int = 300):
    """Start ``ntasks`` processes the way ``srun`` does: only SLURM_* variables tell them their rank."""
    job_id = str(40000 + free_port() % 20000)
    procs = []
    for rank in range(ntasks):
        env = subprocess_env(ntasks)
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks), SLURM_LOCALID=str(rank),
                   SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=job_id)
        procs.append(subprocess.Popen([sys.executable, path, *map(str, args)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise AssertionError(f"slurm-style task failed ({p.returncode}):\n{out[-3000:]}\n{err[-5000:]}")
    return outputs


def run_ppo_local(critic, actor, timeout: int = 900, critic_log=None):
    """``python -m nemo_aligner.launchers.ppo_local`` with the critic's and the actor's overrides (the
    critic after the tiny model's batch sizes); asserts it exits 0."""
    cmd = [sys.executable, "-m", "nemo_aligner.launchers.ppo_local", "--critic", *tiny_batch("serve_ppo_critic.py"),
           *critic, "--actor", *actor]
    if critic_log:
        cmd[3:3] = ["--critic-log", str(critic_log)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def run_script(name: str, overrides, nproc: int = 1, **kwargs):
    return run_python(os.path.join(SCRIPTS, name), overrides, nproc=nproc, **kwargs)


def forward_logits(model, tokens):
    """megatron-core's own full forward (no cache) of ``tokens`` [B, S] from positions 0..S-1, on the
    model's device (a GPU when one is visible); the logits come back on the host."""
    import torch

    tokens = tokens.to(model.device)
    positions = torch.arange(tokens.shape[1], device=model.device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model.module(tokens, positions, None).cpu()


def stub_trainer(cls, **attrs):
    """A trainer object with only the attributes its advantage computation reads."""
    trainer = cls.__new__(cls)
    trainer.__dict__.update(attrs)
    return trainer


def read_metrics(log_dir: str) -> list:
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_losses(log_dir: str) -> dict:
    return {r["step"]: r["train/loss"] for r in read_metrics(log_dir) if "train/loss" in r}


def val_losses(log_dir: str) -> dict:
    return {r["step"]: r["val/loss"] for r in read_metrics(log_dir) if "val/loss" in r}



def built_once(tmp_path_factory, name: str, build):
    """``build(directory)`` run once per test session, its JSON-able result shared: under pytest-xdist
    the first worker to ask builds into a directory of the session's base temp while the others wait
    on a file lock, then read the result (each worker is its own process with its own session)."""
    import tempfile
    from pathlib import Path

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent  # shared by every worker of this run
    result = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not result.is_file():  # a fresh directory: a worker that failed here may have left one
            value = build(Path(tempfile.mkdtemp(prefix=f"{name}_", dir=root)))
            result.write_text(json.dumps(value))
        return json.loads(result.read_text())


@pytest.fixture(scope="session", autouse=True)
def fused_cpu_kernels():
    """The fused CPU kernels, built (first run on a machine) or imported once per test process up
    front, so the tests' child processes (some killed on purpose) only import them."""
    from nemo_aligner.utils import cpu_kernels

    return cpu_kernels.load()


@pytest.fixture(scope="session")
def builtin_data(tmp_path_factory):
    """Every built-in data format (small), written once per session."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    return built_once(tmp_path_factory, "builtin",
                      lambda out: BuiltinTask(seed=0).write_all(str(out), n_train=640, n_val=64))


def _random_base_model(out):
    path = os.path.join(out, "base.nemo")
    run_python(os.path.join(WORKERS, "parallel_loss_worker.py"),
               ["--random-arch", json.dumps(TINY_ARCH), "--save", path, "--out", os.path.join(out, "ref.json")])
    with open(os.path.join(out, "ref.json")) as f:
        return [path, json.load(f)]


@pytest.fixture(scope="session")
def base_nemo(tmp_path_factory):
    """A randomly initialised tiny model saved as a .nemo by one process."""
    return tuple(built_once(tmp_path_factory, "base", _random_base_model))


@pytest.fixture(scope="session")
def mcore_single():
    """torch.distributed (1 gloo process) and megatron-core parallel state in this process."""
    from nemo_aligner.utils import distributed as D

    D.init_distributed()
    D.initialize_model_parallel(1, 1)
    yield
    D.destroy()


def rm_overrides(data, log_dir, steps, extra=()):
    """train_reward_model.py overrides: pairwise comparisons from built-in ``data``, ``steps`` steps."""
    return [
        "++model.data.data_impl=jsonl",
        f"++model.data.data_prefix={{train: [{data['rm_train']}], validation: [{data['rm_val']}], test: [{data['rm_val']}]}}",
        f"exp_manager.explicit_log_dir={log_dir}", f"trainer.rm.max_steps={steps}", "trainer.rm.max_epochs=100",
        *tiny_optim(3e-4, 3e-5, 10), *extra,
    ]


def train_builtin_sft(out, n_train: int, steps: int):
    """SFT of the default tiny GPT on freshly written built-in data under ``out``; returns
    ``(the final .nemo, the data paths)``."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    data = BuiltinTask(seed=0).write_all(str(out / "data"), n_train=n_train, n_val=64)
    run_script("train_gpt_sft.py", [
        f"model.data.train_ds.file_path={data['sft_train']}", f"model.data.validation_ds.file_path={data['sft_val']}",
        f"exp_manager.explicit_log_dir={out / 'run'}", f"trainer.sft.max_steps={steps}", "trainer.sft.max_epochs=100",
        f"trainer.sft.val_check_interval={steps}", "exp_manager.create_checkpoint_callback=True",
        *tiny_optim(1e-3, 1e-4, 10)])
    return str(out / "run" / "checkpoints" / "megatron_gpt_sft.nemo"), data


@pytest.fixture(scope="session")
def sft_nemo(tmp_path_factory):
    """A tiny GPT fine-tuned on the built-in task (the default gpt_sft.yaml shape), as later stages start."""
    return built_once(tmp_path_factory, "sft_model", lambda out: train_builtin_sft(out, n_train=2000, steps=400)[0])


@pytest.fixture(scope="session")
def quick_sft(weak_policy):
    """A policy for the tests of machinery (scripts run, layouts match, runs resume, refusals): the
    weak policy's model, ``sft_nemo``'s shape after 150 steps; ``sft_nemo`` (400 steps) is for the
    tests of what an algorithm learns (``make test-learning``)."""
    return weak_policy[0]


@pytest.fixture(scope="session")
def weak_policy(tmp_path_factory):
    """A tiny GPT after only 150 SFT steps (greedy task score ~0.76): room for RL to improve it.
    Returns ``(nemo path, built-in data paths with 1000 train / 64 val examples)``."""
    return tuple(built_once(tmp_path_factory, "weak_policy", lambda out: train_builtin_sft(out, n_train=1000, steps=150)))


def train_steerlm(out, sft_model: str):
    """SteerLM SFT of ``sft_model`` on built-in chat data labelled quality:0-4 (2000 records, 200 steps);
    returns ``(the .nemo, the data paths)``."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    data = BuiltinTask(seed=0).write_all(str(out / "data"), n_train=2000, n_val=64)
    run_script("train_steerlm_model.py", [
        f"model.restore_from_path={sft_model}", f"model.data.train_ds.file_path={data['steerlm_train']}",
        f"model.data.validation_ds.file_path={data['steerlm_val']}", f"exp_manager.explicit_log_dir={out / 'run'}",
        "trainer.sft.max_steps=200", "trainer.sft.max_epochs=100", "trainer.sft.val_check_interval=200",
        *tiny_optim(1e-3, 1e-4, 10), "exp_manager.create_checkpoint_callback=True"])
    return str(out / "run" / "checkpoints" / "megatron_gpt_steerlm.nemo"), data


@pytest.fixture(scope="session")
def steerlm_nemo(tmp_path_factory, sft_nemo):
    """The SFT model after SteerLM training on the built-in task: ``(.nemo, data paths)``."""
    return tuple(built_once(tmp_path_factory, "steerlm_model", lambda out: train_steerlm(out, sft_nemo)))


def train_regression_rm(out, data, sft_model: str, steps: int = 300):
    """A 2-attribute (quality, verbosity) regression reward model from ``sft_model``, ``steps`` steps;
    returns its log directory (the .nemo is ``checkpoints/megatron_gpt.nemo``)."""
    run_script("train_reward_model.py", [
        f"++model.data.data_prefix={{train: [{data['regression_train']}], validation: [{data['regression_val']}]}}",
        f"exp_manager.explicit_log_dir={out}", f"trainer.rm.max_steps={steps}", "trainer.rm.max_epochs=100",
        f"trainer.rm.val_check_interval={steps}", f"pretrained_checkpoint.restore_from_path={sft_model}",
        "model.reward_model_type=regression", "model.regression.num_attributes=2",
        "model.regression.attribute_names=[quality,verbosity]", *tiny_optim(3e-4, 3e-5, 10)])
    return str(out)


@pytest.fixture(scope="session")
def regression_rm(tmp_path_factory, task_data, sft_nemo):
    """The log directory of a regression reward model of the built-in task's quality and verbosity."""
    return built_once(tmp_path_factory, "regression_rm", lambda out: train_regression_rm(out / "reg", task_data, sft_nemo))


@pytest.fixture(scope="session")
def quick_regression_rm(tmp_path_factory, task_data, quick_sft):
    """``regression_rm``'s model after 4 steps: for tests of what a regression reward model's checkpoint
    says (its attributes), not of what it learned."""
    return built_once(tmp_path_factory, "quick_regression_rm",
                      lambda out: train_regression_rm(out / "reg", task_data, quick_sft, steps=4))


@pytest.fixture(scope="session")
def task_data(tmp_path_factory):
    """Built-in data with 2000 training and 128 validation examples of each format (RM, PPO)."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    return built_once(tmp_path_factory, "task_data",
                      lambda out: BuiltinTask(seed=0).write_all(str(out), n_train=2000, n_val=128))


@pytest.fixture(scope="session")
def reward_model(tmp_path_factory, task_data, sft_nemo):
    """A pairwise reward model trained for 300 steps from the SFT model on the built-in comparisons
    (validated at steps 150 and 300): its accuracy is tested, and PPO optimises it. Returns
    ``(the .nemo, the log directory, the script's stdout)``."""
    from pathlib import Path

    def train(log_dir):
        proc = run_script("train_reward_model.py", rm_overrides(task_data, log_dir, 300, [
            f"pretrained_checkpoint.restore_from_path={sft_nemo}", "trainer.rm.val_check_interval=150"]))
        return [str(log_dir / "checkpoints" / "megatron_gpt.nemo"), str(log_dir), proc.stdout]

    nemo, log_dir, stdout = built_once(tmp_path_factory, "reward_model", train)
    return nemo, Path(log_dir), stdout


@pytest.fixture(scope="session")
def quick_rm(tmp_path_factory, task_data, quick_sft):
    """A pairwise reward model after 8 steps from ``quick_sft`` (its .nemo): for tests of the reward
    model's machinery (servers, critics, commands, loading), which need a reward-model checkpoint but
    not an accurate one; ``reward_model`` (300 steps, learning tests) is the accurate one."""
    def train(log_dir):
        run_script("train_reward_model.py", rm_overrides(task_data, log_dir, 8, [
            f"pretrained_checkpoint.restore_from_path={quick_sft}", "trainer.rm.val_check_interval=8"]))
        return str(log_dir / "checkpoints" / "megatron_gpt.nemo")

    return built_once(tmp_path_factory, "quick_rm", train)


def upcycle_to_experts(dense_nemo: str, out: str, model_cls=None) -> str:
    """A mixture-of-experts copy of a dense .nemo (4 experts, 2 per token): each expert is the dense
    MLP plus its own noise (10% of the weights' spread), the router random. It answers the built-in
    task as the dense model does. ``model_cls``: the role to load and save it as (GPTSFTModel by
    default; MegatronGPTRewardModel keeps a reward model's head). Needs ``mcore_single``."""
    import re

    import torch
    from omegaconf import OmegaConf, open_dict

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import save_nemo

    model_cls = model_cls or GPTSFTModel
    dense = load_model(model_cls, OmegaConf.create({}), "32", dense_nemo, trainable=False)
    cfg = OmegaConf.create(OmegaConf.to_container(dense.cfg, resolve=True))
    with open_dict(cfg):
        cfg.num_moe_experts, cfg.moe_router_topk = 4, 2
    torch.manual_seed(0)
    moe = model_cls(cfg, dense.tokenizer, "32", trainable=False)
    source = dense.module.state_dict()
    noise = torch.Generator().manual_seed(1)
    state = {}
    for key in moe.module.state_dict():
        if key.endswith("_extra_state"):
            continue
        expert = re.match(r"(decoder\.layers\.\d+\.mlp\.)experts\.local_experts\.\d+\.(.*)", key)
        if expert:
            weight = source[expert.group(1) + expert.group(2)]
            state[key] = weight + 0.1 * weight.std() * torch.randn(weight.shape, generator=noise)
        elif key in source:
            state[key] = source[key]
    missing = moe.module.load_state_dict(state, strict=False).missing_keys
    assert [k for k in missing if not k.endswith("_extra_state")] == [k for k in missing if "router" in k]
    return save_nemo(moe, out)


class ServerProcess:
    """A server script (python or torchrun) in its own session, whose output goes to a log; always stopped."""

    def __init__(self, tmp_path, script: str, ready_text: str, nproc: int = 1, like_nproc: int = None):
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        self.script = os.path.join(SCRIPTS, script)
        self.ready_text = ready_text
        self.nproc = nproc
        self.like_nproc = like_nproc  # its device kind (subprocess_env)
        self.port = free_port()
        # Short: PyTriton's unix sockets live in the workspace (paths under ~108 bytes).
        self.workspace = Path(tempfile.mkdtemp(prefix="ws_", dir="/tmp"))
        atexit.register(shutil.rmtree, self.workspace, True)  # also for a test that never calls cleanup()
        self.log = open(tmp_path / f"{os.path.basename(script)}.{self.port}.log", "w+")
        self.proc = None
        self.children = []
        self.final_text = ""

    def start(self, args):
        args = tiny_batch(self.script) + list(args)  # as run_python
        if self.nproc > 1:
            # torchrun's log directory in the workspace: removed with it, none left in /tmp
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.nproc}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                   f"--log-dir={self.workspace / 'torchrun'}", self.script, f"trainer.devices={self.nproc}", *args]
        else:
            cmd = [sys.executable, self.script, *args]
        self.proc = subprocess.Popen(cmd, env=subprocess_env(self.nproc, self.like_nproc), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout=240):
        import time

        import psutil

        deadline = time.time() + timeout
        while time.time() < deadline:
            text = self.text()
            if self.ready_text in text:
                self.children = psutil.Process(self.proc.pid).children(recursive=True)
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited ({self.proc.returncode}):\n{failure_excerpt(text)}")
            time.sleep(0.5)
        raise AssertionError("server not ready in time:\n" + failure_excerpt(self.text()))

    def text(self):
        if self.log.closed:
            return self.final_text
        self.log.seek(0)
        return self.log.read()

    def terminate(self):
        """Ask the server to stop (SIGTERM) without waiting: ``stop()`` waits."""
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self):
        import signal

        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.log.closed:
            self.final_text = self.text()
            self.log.close()

    def cleanup(self):
        import shutil

        shutil.rmtree(self.workspace, ignore_errors=True)

    def __enter__(self):
        """``with srv.start([...]) as srv``: ready inside the block, stopped and cleaned up after it."""
        try:
            return self.wait_ready()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc):
        self.stop()
        self.cleanup()
