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
import re
import shutil
import tarfile
import tempfile
import uuid
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from nemo_aligner.utils.distributed import barrier, first_error_of_any_rank, get_rank
from nemo_aligner.utils.errors import CheckpointError

logger = logging.getLogger(__name__)

MODEL_CONFIG = "model_config.yaml"
MODEL_WEIGHTS = "model_weights"
NEMO_TARGET = "nemo.collections.nlp.models.language_modeling.megatron_gpt_model.MegatronGPTModel"
_NEMO_PREFIX = "nemo:"




def _local_rank() -> int:
    """This process's rank on its node, from whichever launcher started it (mpirun sets no LOCAL_RANK)."""
    from nemo_aligner.utils.launch_info import read_launch_info

    return read_launch_info().local_rank


def check_exists(path: str, key: str) -> None:
    """A clear error naming the config key when a checkpoint path does not exist."""
    if not path:
        raise CheckpointError(f"{key} is empty: give the path of a .nemo file")
    if not os.path.exists(path):
        raise CheckpointError(f"{key}={path}: no such file or directory")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, MODEL_CONFIG)):
            if os.path.isdir(os.path.join(path, "context")) and os.path.isdir(os.path.join(path, "weights")):
                raise CheckpointError(f"{key}={path}: a NeMo 2.0 checkpoint (context/, weights/); NeMo-Aligner's "
                                      "scripts, like these, read NeMo 1.x .nemo files (model_config.yaml, "
                                      "model_weights/): export it with NeMo 2.0 (nemo llm export path=<it> "
                                      "target=hf) and convert that with examples/nlp/gpt/convert_hf_to_nemo.py")
            raise CheckpointError(f"{key}={path}: directory has no {MODEL_CONFIG}; not an extracted .nemo")
    elif not tarfile.is_tarfile(path):  # plain or compressed (gz, bz2, xz)
        raise CheckpointError(f"{key}={path}: not a .nemo file (not a tar archive, plain or compressed)")


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
            return _parse_model_config(f.read(), path, key)
    try:
        with tarfile.open(path, "r:*") as tar:  # NeMo writes plain tars; gz-compressed ones exist too
            member = _member_name(tar, MODEL_CONFIG)
            if member is None:
                raise CheckpointError(f"{key}={path}: the archive has no {MODEL_CONFIG}")
            data = tar.extractfile(member).read().decode("utf-8")
    except tarfile.TarError as err:
        raise CheckpointError(f"{key}={path}: cannot read the archive ({err}); the file may be truncated") from err
    except UnicodeDecodeError:
        raise CheckpointError(f"{key}={path}: {MODEL_CONFIG} is not UTF-8 text") from None
    return _parse_model_config(data, path, key)


def _parse_model_config(text: str, path: str, key: str) -> DictConfig:
    """``model_config.yaml``'s text as a config; anything but a YAML mapping is a CheckpointError."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise CheckpointError(f"{key}={path}: {MODEL_CONFIG} is not valid YAML{where}") from None
    if not isinstance(data, dict) or not data:
        raise CheckpointError(f"{key}={path}: {MODEL_CONFIG} must hold the model's settings (a YAML mapping), got "
                              f"{'nothing' if data is None else type(data).__name__}")
    try:
        # parsed again as OmegaConf (and NeMo) read YAML: `1e-5` is then a float, where YAML 1.1 has a string
        return OmegaConf.create(text)
    except Exception as err:  # e.g. keys OmegaConf cannot hold
        raise CheckpointError(f"{key}={path}: {MODEL_CONFIG} cannot be read as a config ({err})") from None


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
            with tarfile.open(path, "r:*") as tar:
                unsafe = next((m.name for m in tar.getmembers() if _unsafe_member(m)), None)
                if unsafe is not None:
                    raise tarfile.FilterError(f"member {unsafe!r}: absolute path, '..' or a link")
                tar.extractall(target, filter="data")  # and the standard library's own checks
            if not os.path.isfile(os.path.join(target, MODEL_CONFIG)):
                error = f"{key}={path}: the archive has no {MODEL_CONFIG}"
        except tarfile.FilterError as err:
            error = f"{key}={path}: refusing to extract an unsafe archive member ({err})"
        except (tarfile.TarError, OSError) as err:
            error = f"{key}={path}: cannot extract ({err}); the file may be truncated"
    # every rank waits for its node's extraction; a failure on any node stops them all
    error = first_error_of_any_rank(error)
    if error:
        if _local_rank() == 0:  # a refused archive leaves nothing behind, not even a partial extraction
            shutil.rmtree(target, ignore_errors=True)
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
# NeMo stores an artifact as "<uuid4 hex>_<original name>" and refers to it as "nemo:<that name>".
_ARTIFACT_NAME = re.compile(r"^[0-9a-f]{32}_(.+)$")
# model.tokenizer keys whose value is a file (NeMo's register_artifact keys).
TOKENIZER_ARTIFACT_KEYS = ("model", "vocab_file", "merge_file", "tokenizer_model")
# Directories in which NeMo 2 exports and some converters pack a whole Hugging Face tokenizer.
_PACKED_TOKENIZER_DIRS = ("nemo_tokenizer", "tokenizer", "hf_tokenizer")


@atexit.register
def _remove_tokenizer_dirs() -> None:
    for d in _TOKENIZER_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def original_artifact_name(stored: str) -> str:
    match = _ARTIFACT_NAME.match(os.path.basename(stored))
    return match.group(1) if match else os.path.basename(stored)


def _find_artifact(ref: str, nemo_dir: str, key: str) -> str:
    """The file a tokenizer entry names: ``nemo:<name>`` inside the .nemo; otherwise a path on disk,
    or, as NeMo's restore also finds it, a file of that name inside the .nemo."""
    if ref.startswith(_NEMO_PREFIX):
        src = os.path.join(nemo_dir, ref[len(_NEMO_PREFIX):])
        if not os.path.isfile(src):
            raise CheckpointError(f"{key}={ref}: the .nemo has no file {ref[len(_NEMO_PREFIX):]!r}")
        return src
    if os.path.isfile(ref):
        return ref
    base = os.path.basename(ref)
    for entry in sorted(os.listdir(nemo_dir)):
        if entry == base or (original_artifact_name(entry) == base and entry != original_artifact_name(entry)):
            return os.path.join(nemo_dir, entry)
    raise CheckpointError(f"{key}={ref}: neither a file in the .nemo nor on disk")


def restore_tokenizer_files(tokenizer_cfg: DictConfig, nemo_dir: str) -> tuple:
    """Copy the tokenizer files a .nemo holds into a private directory (the extracted .nemo is
    removed after loading). Returns ``(config with local paths, directory of a packed Hugging
    Face tokenizer or None)``; ``type`` is left as the checkpoint has it."""
    cfg = OmegaConf.to_container(tokenizer_cfg, resolve=True) if isinstance(tokenizer_cfg, DictConfig) \
        else dict(tokenizer_cfg or {})
    target = None

    def private_dir() -> str:
        nonlocal target
        if target is None:
            target = tempfile.mkdtemp(prefix="nemo_aligner_tokenizer_")
            _TOKENIZER_DIRS.append(target)
        return target

    def restore(ref: str, key: str) -> str:
        src = _find_artifact(str(ref), nemo_dir, key)
        dst = os.path.join(private_dir(), original_artifact_name(src))
        shutil.copy(src, dst)
        return dst

    for key in TOKENIZER_ARTIFACT_KEYS:
        if cfg.get(key):
            cfg[key] = restore(cfg[key], f"model.tokenizer.{key}")
    if cfg.get("files"):
        cfg["files"] = [restore(ref, "model.tokenizer.files") for ref in cfg["files"]]
    packed = None
    if str(cfg.get("library", "")).lower() in ("huggingface", "hf"):
        for sub in _PACKED_TOKENIZER_DIRS:
            src = os.path.join(nemo_dir, sub)
            if os.path.isdir(src):
                for name in os.listdir(src):
                    if os.path.isfile(os.path.join(src, name)):
                        shutil.copy(os.path.join(src, name), os.path.join(private_dir(), name))
        if target is not None and any(os.path.isfile(os.path.join(target, n))
                                      for n in ("tokenizer.json", "tokenizer_config.json")):
            packed = target
    return cfg, packed


def _tokenizer_artifacts(tokenizer) -> tuple[dict, list]:
    """Tokenizer config for the yaml and ``(stored_name, source_path)`` pairs to add to the tar:
    NeMo's file keys (``model``, ``vocab_file``, ``merge_file``) become ``nemo:<uuid>_<name>``, and
    the other files of a Hugging Face tokenizer are listed under ``files``."""
    cfg = dict(tokenizer.config())
    tag = uuid.uuid4().hex
    pairs = []
    artifacts = tokenizer.artifacts() if hasattr(tokenizer, "artifacts") else {}
    for key, src in artifacts.items():
        name = f"{tag}_{original_artifact_name(src)}"
        pairs.append((name, src))
        cfg[key] = f"{_NEMO_PREFIX}{name}"
    extra = [s for s in (tokenizer.files() if hasattr(tokenizer, "files") else []) if s not in artifacts.values()]
    if extra:
        names = [f"{tag}_{original_artifact_name(src)}" for src in extra]
        pairs.extend(zip(names, extra))
        cfg["files"] = [f"{_NEMO_PREFIX}{name}" for name in names]
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


def peft_weights_file(tp: int, pp: int, tp_rank: int, pp_rank: int) -> str:
    """Where NeMo's adapters-only (PEFT) .nemo keeps a model-parallel rank's adapter weights."""
    if tp == 1 and pp == 1:
        return "model_weights.ckpt"
    if pp == 1:
        return f"mp_rank_{tp_rank:02d}/model_weights.ckpt"
    return f"tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:03d}/model_weights.ckpt"


def _write_adapters(model, staging: str) -> None:
    """This rank's LoRA adapters into ``staging`` as NeMo's PEFT layout (one file per model-parallel rank)."""
    import torch
    from megatron.core import parallel_state

    state = model.nemo_adapter_state()  # on every rank: collective with expert parallelism
    if parallel_state.get_data_parallel_rank() != 0:
        return
    name = peft_weights_file(parallel_state.get_tensor_model_parallel_world_size(),
                             parallel_state.get_pipeline_model_parallel_world_size(),
                             parallel_state.get_tensor_model_parallel_rank(),
                             parallel_state.get_pipeline_model_parallel_rank())
    target = os.path.join(staging, name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    torch.save(state, target)


def save_nemo(model, path: str) -> str:
    """Write ``model`` (a MegatronGPTModel) to ``path`` as a .nemo; collective over all ranks.

    Weights go to ``<path>.tmpdir`` next to the output (it must be visible to every
    rank), rank 0 adds the config and tokenizer and tars it to ``<path>.tmp``, then
    renames; an existing ``path`` stays intact until the rename.
    """
    from nemo_aligner.utils.checkpoint_io import non_finite_tensor, save_sharded

    path = os.path.abspath(path)
    bad = non_finite_tensor(model.module)
    if bad is not None:  # a NaN model must not replace a good file, nor pass for a trained one
        raise CheckpointError(f"{path}: not written, the model's weights are not finite (tensor {bad!r} holds a "
                              "NaN or an infinity)")
    staging = f"{path}.tmpdir"
    error = None
    if get_rank() == 0:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        except OSError as err:  # the parent is a file, a read-only directory, a quota
            error = f"{path}: not written, cannot create {staging} ({err.strerror or err})"
    _stop_if_any_rank_failed(error)  # every rank waits for the staging directory
    export = model.nemo_export() if hasattr(model, "nemo_export") else "full"
    if export == "adapters":
        _write_adapters(model, staging)
    else:
        with model.merged_for_export() if export == "merged" else nullcontext():
            save_sharded(model.sharded_state_dict(adapters=False) if export == "merged" else model.sharded_state_dict(),
                         weights_dir(staging))
    barrier()
    if get_rank() == 0:
        try:
            tokenizer_cfg, artifacts = _tokenizer_artifacts(model.tokenizer)
            config = nemo_model_config(model.model_config_dict(), tokenizer_cfg)
            if export == "merged":
                config["peft"] = dict(config.get("peft") or {}, peft_scheme="none", restore_from_path=None)
            elif export == "adapters":  # NeMo's PEFT config names the base model the adapters go on
                config["restore_from_path"] = model.cfg.get("restore_from_path")
            with open(os.path.join(staging, MODEL_CONFIG), "w", encoding="utf-8") as f:
                yaml.safe_dump(config, f, sort_keys=False)
            for name, src in artifacts:
                shutil.copy(src, os.path.join(staging, name))
            _tar_staging(staging, path)
        except OSError as err:  # disk full while writing the config or an artifact
            shutil.rmtree(staging, ignore_errors=True)
            error = _not_written(path, err)
        except CheckpointError as err:  # _tar_staging's, which cleaned up
            error = str(err)
    _stop_if_any_rank_failed(error)  # the other ranks return only once the file is in place
    return path


def _stop_if_any_rank_failed(error: Optional[str]) -> None:
    """A CheckpointError on every rank when any rank met ``error`` (a collective)."""
    error = first_error_of_any_rank(error)
    if error:
        raise CheckpointError(error)


def _not_written(path: str, err: OSError) -> str:
    return f"{path}: could not be written ({err.strerror or err}); a file already there is kept as it was"


def _tar_staging(staging: str, path: str) -> None:
    """``staging``'s files as the .nemo ``path`` (written to ``<path>.tmp``, then renamed over it);
    ``staging`` is removed."""
    tmp = f"{path}.tmp"
    try:
        with tarfile.open(tmp, "w:") as tar:
            for name in sorted(os.listdir(staging)):
                tar.add(os.path.join(staging, name), arcname=f"./{name}")
    except OSError as err:  # disk full, a quota
        shutil.rmtree(staging, ignore_errors=True)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise CheckpointError(_not_written(path, err)) from None
    os.replace(tmp, path)
    shutil.rmtree(staging, ignore_errors=True)


def write_adapters_nemo(path: str, config: dict, state: dict) -> str:
    """An adapters-only .nemo (NeMo's PEFT layout at TP=1, PP=1) from a model config and its adapter
    tensors, written by this process alone."""
    import torch

    path = os.path.abspath(path)
    staging = f"{path}.tmpdir"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    with open(os.path.join(staging, MODEL_CONFIG), "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    torch.save(state, os.path.join(staging, peft_weights_file(1, 1, 0, 0)))
    _tar_staging(staging, path)
    return path


def list_members(path: str) -> list:
    """Names inside a .nemo (tests, diagnostics)."""
    with tarfile.open(path, "r:*") as tar:
        return [m.name[2:] if m.name.startswith("./") else m.name for m in tar.getmembers()]




def tokenizer_from_path(path: str, kind: Optional[str] = None, key: str = "tokenizer_path",
                        kind_key: str = "tokenizer_type"):
    """The tokenizer ``path`` names: a .nemo (file or directory), a SentencePiece model, or a Hugging
    Face tokenizer directory or name. ``kind`` (``sentencepiece``/``huggingface``) picks between the
    last two; by default a ``.model`` file is SentencePiece."""
    from nemo_aligner.utils.errors import ConfigError
    from nemo_aligner.utils.tokenizers import build_tokenizer

    path = str(path)
    if path.endswith(".nemo") or os.path.isfile(os.path.join(path, MODEL_CONFIG)):
        return load_tokenizer(path, key)
    kind = str(kind or ("sentencepiece" if path.endswith(".model") else "huggingface"))
    if kind == "sentencepiece":
        return build_tokenizer({"library": "sentencepiece", "model": path})
    if kind == "huggingface":
        return build_tokenizer({"library": "huggingface", "type": path})
    raise ConfigError(f"{kind_key}={kind!r} must be sentencepiece or huggingface")


def restored_tokenizer(model_cfg, directory: str, what: str) -> tuple:
    """``(tokenizer, its config with local paths)`` of ``model_cfg.tokenizer``, its files restored from
    the extracted .nemo ``directory``; files the tokenizer library cannot read are named with ``what``."""
    from nemo_aligner.utils.tokenizers import build_tokenizer

    tokenizer_cfg, packed = restore_tokenizer_files(model_cfg.get("tokenizer") or OmegaConf.create({}), directory)
    try:
        tokenizer = build_tokenizer(tokenizer_cfg, padded_vocab_size=model_cfg.get("padded_vocab_size"),
                                    packed_dir=packed)
    except CheckpointError as err:  # the files came from the .nemo: name it
        raise CheckpointError(f"{what}: {err}") from None
    return tokenizer, tokenizer_cfg


def load_tokenizer(path: str, key: str = "restore_from_path"):
    """The tokenizer a ``.nemo`` file was saved with (its files kept in a temp dir while in use)."""
    cfg = read_model_config(path, key)
    with extracted(path, key) as directory:
        return restored_tokenizer(cfg, directory, f"{key}={path}")[0]
