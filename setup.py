"""nemo-aligner: ``pip install .`` into an environment that has torch (a container's own build is kept).

install_requires are ranges; the exact versions ``make test`` installs live in constraints.txt."""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithExamples(build_py):
    """Copy ``examples/`` (the Hydra scripts and their configs) into the built package as
    ``nemo_aligner/_examples``: the Python API composes those configs, and ``ppo_local`` and the demo
    run those scripts, so a wheel or ``pip install .`` needs them too (see utils/examples_path.py)."""

    def run(self):
        super().run()
        source = os.path.join(HERE, "examples")
        if self.dry_run or not os.path.isdir(source):
            return
        target = os.path.join(self.build_lib, "nemo_aligner", "_examples")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def read_version() -> str:
    with open(os.path.join(HERE, "nemo_aligner", "__init__.py"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("__version__"):
                return line.split("=")[1].strip().strip('"')
    raise RuntimeError("no __version__")


setup(
    name="nemo-aligner",
    version=read_version(),
    description="Align GPT models with SFT, reward models, PPO, DPO and SteerLM on megatron-core",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # csrc holds no Python: listed so setuptools installs its C++ source as package data
    packages=find_packages(include=["nemo_aligner", "nemo_aligner.*", "nemo_rl", "nemo_rl.*"]) + ["nemo_aligner.csrc"],
    include_package_data=True,
    # the fused CPU decode kernels' source, compiled on first use (utils/cpu_kernels.py)
    package_data={"nemo_aligner": ["csrc/*.cpp"]},
    install_requires=[
        # Ranges, so that pip keeps a container's torch (NVIDIA's builds are versioned like
        # 2.9.0a0+<hash>.nv25.10, which these admit). Tested ends: torch 2.6/2.13/2.15, megatron-core
        # 0.16/0.19 (README, "Install"); megatron-core 0.17+ needs Python 3.12.
        "torch>=2.6",
        "megatron-core>=0.16,<0.20",
        # megatron-core needs these but does not declare them: without psutil a checkpoint
        # save hangs (its writer process dies), tqdm is used by its inference engine.
        "psutil",
        "tqdm",
        "nvidia-pytriton>=0.7",
        "numpy<2",  # nvidia-pytriton 0.7 requires numpy<2
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
        "pyyaml",
        "tensorboard",
        "wandb",
        "transformers",
        "safetensors",
        # NeMo's tokenizer libraries (model.tokenizer.library: sentencepiece, tiktoken)
        "sentencepiece",
        "tiktoken",
        "matplotlib",  # make demo: results/demo/report.png
        "ninja",  # builds the fused CPU decode kernels on first use (utils/cpu_kernels.py)
    ],
    extras_require={
        # peft: the LoRA conversion tests load the converted adapters with Hugging Face's own library
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "filelock", "numcodecs", "peft"],
        # zarr-format distributed checkpoints (NeMo's dist_ckpt_format: zarr) are Blosc-compressed
        "zarr": ["numcodecs"],
        "gpu": ["transformer-engine[pytorch]"],
    },
    cmdclass={"build_py": BuildPyWithExamples},
    entry_points={
        "console_scripts": [
            "nemo-aligner-builtin-data=nemo_aligner.data.nlp.builtin_task:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
    ],
)
