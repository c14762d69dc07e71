"""nemo-aligner: align GPT models with SFT, reward models, PPO, DPO and SteerLM on megatron-core."""

import logging as _logging
import warnings as _warnings

__version__ = "0.1.0"

# Expected by design (no apex; Transformer Engine optional; megatron-core's own use of
# deprecated torch.distributed.checkpoint APIs): hide them so real warnings stand out.
for _message in (
    r".*Apex is not installed.*",
    r".*Transformer Engine and Apex are not installed.*",
    r".*full scope is deprecated.*",
    r".*Please use DTensor instead and we are deprecating ShardedTensor.*",
    r".*`load_state_dict` is deprecated and will be removed.*",
):
    _warnings.filterwarnings("ignore", message=_message)
# megatron-core logs its whole config at INFO on every model and optimizer build.
_logging.getLogger("megatron").setLevel(_logging.WARNING)
_logging.getLogger("pytriton").setLevel(_logging.WARNING)

# megatron-core's import-time torch.compile decorators import the compiler (2-3 s per process).
from nemo_aligner.utils import patches as _patches  # noqa: E402

_patches.apply_at_import()


def __getattr__(name):
    """``from nemo_aligner import GRPOTrainer`` etc., imported on first use (``import nemo_aligner`` stays light)."""
    import importlib

    trainers = importlib.import_module("nemo_aligner.trainers")  # not ``from nemo_aligner import``: that asks here
    if name in trainers.__all__:
        return getattr(trainers, name)
    raise AttributeError(f"module 'nemo_aligner' has no attribute {name!r}")
