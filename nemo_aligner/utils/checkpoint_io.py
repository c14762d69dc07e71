"""Atomic save and checked load of megatron-core torch_dist sharded checkpoints."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shutil
import typing
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from nemo_aligner.utils.distributed import barrier, get_rank
from nemo_aligner.utils.errors import CheckpointError
from nemo_aligner.utils.patches.checkpoint_results import use_in_process_results_queue

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def nemo_written_objects():
    """Let torch's safe loader (``weights_only``) read what NeMo's training checkpoints keep in
    ``common.pt`` beside tensors and plain values: the model config as OmegaConf objects
    (Lightning's ``hyper_parameters.cfg``). Nothing that runs code on loading is allowed."""
    import omegaconf
    from omegaconf import base, nodes

    allowed = [omegaconf.DictConfig, omegaconf.ListConfig, base.ContainerMetadata, base.Metadata,
               collections.defaultdict, dict, list, tuple, int, float, str, bool, bytes, (typing.Any, "typing.Any")]
    allowed += [getattr(nodes, name) for name in ("AnyNode", "StringNode", "IntegerNode", "FloatNode",
                                                  "BooleanNode", "BytesNode", "PathNode") if hasattr(nodes, name)]
    with torch.serialization.safe_globals(allowed):
        yield



def _flatten(sharded_state_dict: dict, prefix: str = "") -> Iterable[Tuple[str, object]]:
    for key, value in sharded_state_dict.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def replace_dir_atomically(tmp_dir: str, final_dir: str) -> None:
    """Move a finished ``tmp_dir`` to ``final_dir``; an existing ``final_dir`` is kept until the swap."""
    old = None
    if os.path.exists(final_dir):
        old = f"{final_dir}.old.{os.getpid()}"
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


REMOVING_SUFFIX = ".removing"


def remove_dir_atomically(path: str) -> None:
    """Delete a checkpoint directory so that a kill part-way never leaves a half-deleted one under
    its own name: it is renamed to ``<path>.removing`` first (one atomic step), then deleted."""
    doomed = f"{path}{REMOVING_SUFFIX}"
    if os.path.exists(doomed):  # an earlier deletion of the same name, interrupted
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def recover_replaced_dir(final_dir: str) -> None:
    """Tidy what an interrupted :func:`replace_dir_atomically` or :func:`remove_dir_atomically` of
    ``final_dir`` left beside it (for outputs outside a checkpoint directory, such as an export):
    a previous version moved aside is put back if ``final_dir`` is missing, else removed."""
    final_dir = final_dir.rstrip("/")
    parent, name = os.path.split(os.path.abspath(final_dir))
    if not os.path.isdir(parent):
        return
    for entry in sorted(os.listdir(parent)):
        path = os.path.join(parent, entry)
        if entry.startswith(f"{name}.old.") and os.path.isdir(path):
            _restore_or_drop(path, final_dir)
        elif entry == f"{name}{REMOVING_SUFFIX}" and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def recover_interrupted_saves(directory: str) -> None:
    """Tidy ``directory`` after a process was killed mid-save (call on one rank, before resuming):
    a ``<name>.tmp`` write never committed is removed; a ``<name>.old.<pid>`` whose replacement was
    never renamed in is put back as ``<name>`` (else removed); a ``<name>.removing`` left by an
    interrupted prune is removed, as are an interrupted ``.nemo`` save's ``.nemo.tmp`` and
    ``.nemo.tmpdir``."""
    if not os.path.isdir(directory):
        return
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if entry.endswith(".tmp") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("removed %s: a checkpoint save that was interrupted", path)
        elif entry.endswith(REMOVING_SUFFIX) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("removed %s: a checkpoint deletion that was interrupted", path)
        elif entry.endswith(".nemo.tmpdir") and os.path.isdir(path):  # save_nemo's staging copy of the weights
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("removed %s: a .nemo save that was interrupted", path)
        elif entry.endswith(".nemo.tmp") and os.path.isfile(path):
            os.remove(path)
            logger.warning("removed %s: a .nemo save that was interrupted", path)
        elif ".old." in entry and os.path.isdir(path):
            _restore_or_drop(path, os.path.join(directory, entry.rsplit(".old.", 1)[0]))


def _restore_or_drop(moved: str, final: str) -> None:
    """A version ``replace_dir_atomically`` moved aside: put back when nothing replaced it, else removed."""
    if os.path.exists(final):
        shutil.rmtree(moved, ignore_errors=True)
    else:
        os.replace(moved, final)
        logger.warning("restored %s: its replacement was interrupted before it was renamed in", final)


def save_sharded(sharded_state_dict: dict, directory: str, content_metadata: Optional[dict] = None,
                 before_commit: Optional[Callable[[str], None]] = None) -> None:
    """Save a sharded state dict to ``directory`` as torch_dist; a crash mid-save leaves any old copy intact.

    Every rank writes into ``<directory>.tmp`` first (``before_commit(tmp_dir)`` lets each
    rank add its own files there); rank 0 renames it when all are done.
    """
    from megatron.core import dist_checkpointing

    directory = os.path.abspath(directory)
    tmp_dir = f"{directory}.tmp"
    if get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
    barrier()
    use_in_process_results_queue()
    try:
        dist_checkpointing.save(sharded_state_dict, tmp_dir, content_metadata=content_metadata)
        if before_commit is not None:
            before_commit(tmp_dir)
    except (Exception, _dcp_exception()) as err:  # disk full, a quota, a vanished mount
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise CheckpointError(f"{directory}: could not be written ({_short(err)}); nothing was replaced (an "
                              "earlier checkpoint of that name, and every other, is kept)") from None
    barrier()
    if get_rank() == 0:
        _write_common_file(tmp_dir)
        replace_dir_atomically(tmp_dir, directory)
    barrier()


def _write_common_file(directory: str) -> None:
    """Keep ``common.pt`` beside the shards. megatron-core 0.17+ stores the non-tensor state inside
    the torch_dist files instead, which NeMo on megatron-core up to 0.16 cannot read; both read
    ``common.pt``."""
    from megatron.core import dist_checkpointing

    path = os.path.join(directory, "common.pt")
    if not os.path.isfile(path):
        torch.save(dist_checkpointing.load_common_state_dict(directory), path)


def non_finite_tensor(module: torch.nn.Module) -> Optional[str]:
    """The name of this rank's first parameter holding a NaN or an infinity (None if all are
    finite), agreed over every rank: a non-finite name anywhere makes every rank return one."""
    import torch.distributed as dist

    found = None
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not bool(torch.isfinite(param).all()):
                found = name
                break
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from nemo_aligner.utils.distributed import host_all_reduce

        anywhere = host_all_reduce(torch.tensor([0 if found is None else 1]), op=dist.ReduceOp.MAX)
        if int(anywhere[0]) and found is None:
            found = "(a parameter on another rank)"
    return found


def checkpoint_shapes(directory: str, what: str = "checkpoint") -> Dict[str, Tuple[int, ...]]:
    """Global shape of every tensor stored in a torch_dist checkpoint."""
    return checkpoint_contents(directory, what)[0]


def checkpoint_contents(directory: str, what: str = "checkpoint") -> Tuple[Dict[str, Tuple[int, ...]], set]:
    """What a torch_dist checkpoint stores, from one read of its metadata: the global shape of every
    tensor, and the keys of its non-tensor entries (megatron-core's ``ShardedObject``s, such as a
    layer's ``_extra_state``) without their ``/shard_...`` suffix.

    Read from torch's own checkpoint metadata: megatron-core's ``load_tensors_metadata`` passes every
    stored tensor property to ``torch.empty``, which fails from torch 2.15 on (``strides``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    try:
        entries = FileSystemReader(directory).read_metadata().state_dict_metadata
    except (Exception, _dcp_exception()) as err:  # missing, empty, cut short or damaged .metadata (a pickle)
        raise CheckpointError(f"{what} {directory}: its index (.metadata) cannot be read ({type(err).__name__}: "
                              f"{_short(err)}); the checkpoint is damaged or incomplete") from None
    shapes = {key: tuple(meta.size) for key, meta in entries.items() if isinstance(meta, TensorStorageMetadata)}
    objects = {key.split("/shard_")[0] for key, meta in entries.items() if isinstance(meta, BytesStorageMetadata)}
    return shapes, objects


def checkpoint_dir_named(path: str) -> str:
    """``path``; for ``<name>.ckpt`` that is not there, the directory ``<name>`` when it is: NeMo and
    Lightning name a distributed checkpoint ``<name>.ckpt`` in their logs and write it as ``<name>/``."""
    if not os.path.exists(path) and path.endswith(".ckpt") and os.path.isdir(path[: -len(".ckpt")]):
        return path[: -len(".ckpt")]
    return path


def is_sharded_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "metadata.json"))


def load_sharded(
    sharded_state_dict: dict,
    directory: str,
    allow_missing: Iterable[str] = (),
    what: str = "checkpoint",
) -> Tuple[dict, list]:
    """Load ``sharded_state_dict`` from ``directory`` after checking keys and shapes.

    Tensors whose key contains one of ``allow_missing`` may be absent from the
    checkpoint (a new reward head, say): they keep their current values and are
    returned in the second element. Any other absent key or shape mismatch is a
    ``CheckpointError`` that names the tensor.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    if not is_sharded_checkpoint(directory):
        raise CheckpointError(f"{what} {directory}: not a torch_dist checkpoint (no metadata.json)")
    stored, stored_objects = checkpoint_contents(directory, what)
    missing, mismatched = [], []

    def prune(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = prune(value, f"{prefix}{key}.")
                continue
            if isinstance(value, ShardedObject) and any(tag in value.key for tag in allow_missing):
                continue  # extra state of a module that is new in this model (e.g. a reward head)
            if isinstance(value, ShardedObject) and value.key.endswith("_extra_state") and \
                    value.key not in stored_objects:
                # a module state the other layer spec does not write (Transformer Engine's attention
                # keeps FP8 metadata; the local spec has none): the module keeps its own
                continue
            if isinstance(value, ShardedTensorFactory) and value.key not in stored and \
                    any(tag in value.key for tag in allow_missing):
                missing.append(value.key)  # a new gated-MLP tensor (e.g. a LoRA adapter on fc1)
                continue
            if isinstance(value, ShardedTensor):
                if value.key not in stored and _norm_alias(value.key) in stored:
                    value.key = _norm_alias(value.key)  # Transformer Engine's fused norm names, or the reverse
                if value.key not in stored:
                    if any(tag in value.key for tag in allow_missing):
                        missing.append(value.key)
                        continue
                    missing.append(value.key)
                elif tuple(value.global_shape) != stored[value.key]:
                    mismatched.append((value.key, stored[value.key], tuple(value.global_shape)))
            out[key] = value
        return out

    to_load = prune(sharded_state_dict)
    not_allowed = [k for k in missing if not any(tag in k for tag in allow_missing)]
    if mismatched:
        key, have, want = mismatched[0]
        raise CheckpointError(
            f"{what} {directory}: tensor {key!r} has shape {list(have)} in the checkpoint but "
            f"{list(want)} in the model built from the config ({len(mismatched)} tensor(s) differ); "
            "the model.* architecture keys do not match this checkpoint"
        )
    if not_allowed:
        raise CheckpointError(
            f"{what} {directory}: tensor {not_allowed[0]!r} is missing from the checkpoint "
            f"({len(not_allowed)} missing); it was saved from a different model"
        )
    try:
        with nemo_written_objects():
            loaded = dist_checkpointing.load(to_load, directory)
    except (Exception, _dcp_exception()) as err:  # torch DCP's CheckpointException is a BaseException
        _refuse_unsafe_object(err, what, directory)
        raise CheckpointError(f"{what} {directory}: could not be loaded ({_short(err)}); the checkpoint is "
                              "damaged or incomplete: move it aside to resume from an earlier one") from err
    return loaded, [k for k in missing if k not in not_allowed]


def _norm_alias(key: str) -> str:
    """The other spec's name of a layer norm (``...input_layernorm.weight`` <->
    ``...self_attention.linear_qkv.layer_norm_weight``), else ``key`` itself."""
    from nemo_aligner.utils.legacy_checkpoint import TE_NORM_ALIASES

    for local, te in TE_NORM_ALIASES.items():
        if key.endswith(f"layers.{local}"):
            return key[: -len(local)] + te
        if key.endswith(f"layers.{te}"):
            return key[: -len(te)] + local
    return key


def _dcp_exception() -> type:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return Exception
    return CheckpointException


def _refuse_unsafe_object(err: BaseException, what: str, directory: str) -> None:
    """torch's safe loader met an object of a type it does not unpickle: name it (not 'damaged')."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    if found:
        raise CheckpointError(f"{what} {directory}: holds a {found.group(1)} object beside its tensors, which is "
                              "not unpickled (loading it could run code); its weights can be read once that "
                              "object is gone (e.g. saved again as a .nemo)") from None


def _short(err: BaseException) -> str:
    """The last line that says what failed (torch DCP's messages carry whole remote tracebacks)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line and ":" in line:
            return line
    return lines[-1] if lines else type(err).__name__


def load_common(directory: str) -> dict:
    """The non-sharded part (``common.pt``) of a torch_dist checkpoint."""
    from megatron.core import dist_checkpointing

    has_file = os.path.isfile(os.path.join(directory, "common.pt"))  # megatron-core 0.17+: inside the shards
    try:
        with nemo_written_objects():
            return dist_checkpointing.load_common_state_dict(directory)
    except (Exception, _dcp_exception()) as err:
        _refuse_unsafe_object(err, "checkpoint", directory)
        problem = f"common.pt cannot be read ({_short(err)})" if has_file else "common.pt is missing"
        raise CheckpointError(f"checkpoint {directory}: {problem}; the checkpoint is damaged or incomplete: move it "
                              "aside to resume from an earlier one") from None


def copy_into_model(module: torch.nn.Module, loaded: dict, prefix: str = "model.") -> None:
    """Load a state dict returned by ``load_sharded`` into ``module`` (keys from its sharded_state_dict)."""
    # megatron-core's sharded load returns plain tensors under the same nested keys as the
    # request; GPTModel.load_state_dict understands them after stripping the prefix.
    state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in loaded.items()}
    module.load_state_dict(state, strict=False)
