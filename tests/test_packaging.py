"""A built package (what a wheel or `pip install .` installs) carries the example scripts and
their configs and the decode kernels' C++ source, so the Python API, ppo_local and the demo work without a source checkout."""

import os
import subprocess
import sys

from conftest import REPO, subprocess_env


def test_built_package_carries_the_configs_and_scripts(tmp_path):
    build = tmp_path / "lib"
    # setup.py's build_py is what bdist_wheel (and so pip) runs to lay out the package
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    packaged = build / "nemo_aligner" / "_examples" / "nlp" / "gpt"
    for name in ("conf/gpt_grpo.yaml", "conf/gpt_sft.yaml", "serve_ppo_critic.py", "train_gpt_ppo_actor.py"):
        assert (packaged / name).is_file(), name
    assert not (build / "nemo_aligner" / "_examples" / "nlp" / "gpt" / "__pycache__").exists()
    assert (build / "nemo_aligner" / "csrc" / "cpu_kernels.cpp").is_file()  # the decode kernels' source
    # Run from elsewhere, with the built package first on the path: it must use its own copy.
    env = dict(subprocess_env(), PYTHONPATH=str(build))
    check = """
import os, nemo_aligner
from nemo_aligner.trainers.base import CONF_DIR, compose_config
from nemo_aligner.launchers import ppo_local
from nemo_aligner.utils import cpu_kernels
assert cpu_kernels.SOURCE.startswith(os.environ["PYTHONPATH"]) and os.path.isfile(cpu_kernels.SOURCE)
assert nemo_aligner.__file__.startswith(os.environ["PYTHONPATH"]), nemo_aligner.__file__
assert CONF_DIR.startswith(os.environ["PYTHONPATH"]) and ppo_local.SCRIPTS.startswith(os.environ["PYTHONPATH"])
print("LR", compose_config("gpt_grpo", {"model.optim.lr": 3e-6}).model.optim.lr)
"""
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LR 3e-06" in proc.stdout
    # A packaged script composes its config (Hydra's --cfg job prints it without running).
    proc = subprocess.run([sys.executable, str(packaged / "train_gpt_sft.py"), "--cfg", "job"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restore_from_path" in proc.stdout


def test_install_keeps_a_containers_own_torch(tmp_path):
    """``pip install .`` into an environment whose torch is a container's build (NVIDIA versions theirs
    like ``2.9.0a0+<hash>.nv25.10``) plans no change to torch: install_requires are ranges. Offline
    (``--no-index``): had pip wanted another torch, it would fail to find one."""
    import json
    import sysconfig

    venv = tmp_path / "container"
    # No pip or setuptools of its own: this environment's, through the .pth file below.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The container's other packages: this environment's, seen through a .pth file ...
    with open(os.path.join(site, "base_env.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    # ... and its own torch, found first (its dist-info is all pip reads).
    version = "2.9.0a0+40ec155e58.nv25.10"
    info = os.path.join(site, f"torch-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    open(os.path.join(info, "RECORD"), "w").close()
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--report", str(report), "-q", REPO], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PIP_CONSTRAINT="", PIP_FIND_LINKS=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    planned = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert planned == {"nemo-aligner"}, planned
