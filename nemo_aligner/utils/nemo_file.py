""".nemo files, written and read without NeMo, in NeMo's megatron-core layout.

A ``.nemo`` is an uncompressed tar holding::

    model_config.yaml              (mcore_gpt: True, dist_ckpt_format: torch_dist, tokenizer, sizes)
    <uuid>_<tokenizer file>        (tokenizer artifacts, referenced as nemo:<uuid>_<name>)
    model_weights/                 (megatron-core torch_dist checkpoint: metadata.json, common.pt,
                                    .metadata, __*_*.distcp)

A directory with the same content (an "extracted .nemo") is accepted wherever a
``.nemo`` is.
"""

from __future__ import annotations

import atexit
import hashlib

import logging
import os
import shutil
import tarfile
import tempfile
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from nemo_aligner.utils.distributed import barrier, get_rank
from nemo_aligner.utils.errors import CheckpointError

logger = logging.getLogger(__name__)

MODEL_CONFIG = "model_config.yaml"
MODEL_WEIGHTS = "model_weights"
NEMO_TARGET = "nemo.collections.nlp.models.language_modeling.megatron_gpt_model.MegatronGPTModel"
_NEMO_PREFIX = "nemo:"




def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))


def check_exists(path: str, key: str) -> None:
    """A clear error naming the config key when a checkpoint path does not exist."""
    if not path:
        raise CheckpointError(f"{key} is empty: give the path of a .nemo file")
    if not os.path.exists(path):
        raise CheckpointError(f"{key}={path}: no such file or directory")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, MODEL_CONFIG)):
            raise CheckpointError(f"{key}={path}: directory has no {MODEL_CONFIG}; not an extracted .nemo")
    elif not tarfile.is_tarfile(path):
        raise CheckpointError(f"{key}={path}: not a .nemo file (not a tar archive)")


def _member_name(tar: tarfile.TarFile, name: str) -> Optional[str]:
    for candidate in (name, f"./{name}"):
        try:
            tar.getmember(candidate)
            return candidate
        except KeyError:
            continue
    return None


def read_model_config(path: str, key: str = "restore_from_path") -> DictConfig:
    """``model_config.yaml`` of a .nemo (file or directory) without extracting the weights."""
    check_exists(path, key)
    if os.path.isdir(path):
        with open(os.path.join(path, MODEL_CONFIG), encoding="utf-8") as f:
            return OmegaConf.create(yaml.safe_load(f))
    try:
        with tarfile.open(path, "r:") as tar:
            member = _member_name(tar, MODEL_CONFIG)
            if member is None:
                raise CheckpointError(f"{key}={path}: the archive has no {MODEL_CONFIG}")
            data = tar.extractfile(member).read().decode("utf-8")
    except tarfile.TarError as err:
        raise CheckpointError(f"{key}={path}: cannot read the archive ({err}); the file may be truncated") from err
    return OmegaConf.create(yaml.safe_load(data))


def _job_tag() -> str:
    """What the processes of one job on this node share and no other job's do: local rank 0 extracts
    for all of them, and removes the directory afterwards, so two jobs must never share one.
    torchrun's run id is the string "none" unless given, so the rendezvous address (a free port per
    job) is used; a Slurm step's tasks share its job and step ids; a lone process, its pid."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    if os.environ.get("MASTER_PORT"):
        return f"{os.environ.get('MASTER_ADDR', '')}-{os.environ['MASTER_PORT']}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '')}"
    return f"pid{os.getpid()}"


def _extract_dir_for(path: str) -> str:
    stat = os.stat(path)
    digest = hashlib.sha1(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    tag = hashlib.sha1(_job_tag().encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"nemo_aligner_{os.getuid()}_{digest}_{tag}")


def _unsafe_member(member: tarfile.TarInfo) -> bool:
    """A .nemo holds plain files and directories with relative names; anything else is refused."""
    name = member.name.replace("\\", "/")
    return (name.startswith("/") or ".." in name.split("/") or member.issym() or member.islnk()
            or not (member.isfile() or member.isdir()))


@contextmanager
def extracted(path: str, key: str = "restore_from_path") -> Iterator[str]:
    """Yield a directory with the .nemo's content; extracted once per node and removed afterwards."""
    check_exists(path, key)
    if os.path.isdir(path):
        yield path
        return
    target = _extract_dir_for(path)
    error = None
    if _local_rank() == 0:
        try:
            shutil.rmtree(target, ignore_errors=True)
            os.makedirs(target)
            with tarfile.open(path, "r:") as tar:
                unsafe = next((m.name for m in tar.getmembers() if _unsafe_member(m)), None)
                if unsafe is not None:
                    raise tarfile.FilterError(f"member {unsafe!r}: absolute path, '..' or a link")
                tar.extractall(target, filter="data")  # and the standard library's own checks
        except tarfile.FilterError as err:
            error = f"{key}={path}: refusing to extract an unsafe archive member ({err})"
        except (tarfile.TarError, OSError) as err:
            error = f"{key}={path}: cannot extract ({err}); the file may be truncated"
    barrier()
    if error is None and not os.path.isfile(os.path.join(target, MODEL_CONFIG)):
        error = f"{key}={path}: the archive has no {MODEL_CONFIG}"
    if error:
        raise CheckpointError(error)
    try:
        yield target
    finally:
        barrier()
        if _local_rank() == 0:
            shutil.rmtree(target, ignore_errors=True)


def weights_dir(nemo_dir: str) -> str:
    return os.path.join(nemo_dir, MODEL_WEIGHTS)


# ----------------------------------------------------------------- tokenizer artifacts
_TOKENIZER_DIRS = []


@atexit.register
def _remove_tokenizer_dirs() -> None:
    for d in _TOKENIZER_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def restore_tokenizer_files(tokenizer_cfg: DictConfig, nemo_dir: str) -> DictConfig:
    """Copy ``nemo:<uuid>_<name>`` artifacts into a private directory; return the config pointing at it."""
    files = list(tokenizer_cfg.get("files") or [])
    if not files:
        return tokenizer_cfg
    target = tempfile.mkdtemp(prefix="nemo_aligner_tokenizer_")
    _TOKENIZER_DIRS.append(target)
    for ref in files:
        stored = ref[len(_NEMO_PREFIX):] if ref.startswith(_NEMO_PREFIX) else ref
        src = os.path.join(nemo_dir, stored)
        if not os.path.isfile(src):
            raise CheckpointError(f"{nemo_dir}: tokenizer artifact {ref} is missing")
        original = stored.split("_", 1)[1] if "_" in stored else stored
        shutil.copy(src, os.path.join(target, original))
    cfg = OmegaConf.create(OmegaConf.to_container(tokenizer_cfg))
    cfg.type = target
    return cfg


def _tokenizer_artifacts(tokenizer) -> tuple[dict, list]:
    """Tokenizer config for the yaml and ``(stored_name, source_path)`` pairs to add to the tar."""
    cfg = dict(tokenizer.config())
    sources = tokenizer.files() if hasattr(tokenizer, "files") else []
    if not sources:
        return cfg, []
    tag = uuid.uuid4().hex
    pairs = [(f"{tag}_{os.path.basename(src)}", src) for src in sources]
    cfg["files"] = [f"{_NEMO_PREFIX}{name}" for name, _ in pairs]
    return cfg, pairs


# ----------------------------------------------------------------- writing
def nemo_model_config(model_cfg: dict, tokenizer_cfg: dict) -> dict:
    """NeMo's keys on top of our model config."""
    cfg = dict(model_cfg)
    cfg.pop("restore_from_path", None)
    cfg["mcore_gpt"] = True
    cfg["dist_ckpt_format"] = "torch_dist"
    cfg["tokenizer"] = tokenizer_cfg
    cfg.setdefault("target", NEMO_TARGET)
    return cfg


def save_nemo(model, path: str) -> str:
    """Write ``model`` (a MegatronGPTModel) to ``path`` as a .nemo; collective over all ranks.

    Weights go to ``<path>.tmpdir`` next to the output (it must be visible to every
    rank), rank 0 adds the config and tokenizer and tars it to ``<path>.tmp``, then
    renames; an existing ``path`` stays intact until the rename.
    """
    from nemo_aligner.utils.checkpoint_io import save_sharded

    path = os.path.abspath(path)
    staging = f"{path}.tmpdir"
    if get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    barrier()
    save_sharded(model.sharded_state_dict(), weights_dir(staging))
    if get_rank() == 0:
        tokenizer_cfg, artifacts = _tokenizer_artifacts(model.tokenizer)
        config = nemo_model_config(model.model_config_dict(), tokenizer_cfg)
        with open(os.path.join(staging, MODEL_CONFIG), "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        for name, src in artifacts:
            shutil.copy(src, os.path.join(staging, name))
        tmp = f"{path}.tmp"
        with tarfile.open(tmp, "w:") as tar:
            for name in sorted(os.listdir(staging)):
                tar.add(os.path.join(staging, name), arcname=f"./{name}")
        os.replace(tmp, path)
        shutil.rmtree(staging, ignore_errors=True)
    barrier()
    return path


def list_members(path: str) -> list:
    """Names inside a .nemo (tests, diagnostics)."""
    with tarfile.open(path, "r:") as tar:
        return [m.name[2:] if m.name.startswith("./") else m.name for m in tar.getmembers()]




def load_tokenizer(path: str, key: str = "restore_from_path"):
    """The tokenizer a ``.nemo`` file was saved with (its files kept in a temp dir while in use)."""
    from nemo_aligner.utils.tokenizers import build_tokenizer

    cfg = read_model_config(path, key)
    with extracted(path, key) as directory:
        return build_tokenizer(restore_tokenizer_files(cfg.get("tokenizer") or OmegaConf.create({}), directory))
