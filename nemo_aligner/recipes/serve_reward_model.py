"""``serve_reward_model.py``: a reward model served over PyTriton until stopped."""

from __future__ import annotations

from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
from nemo_aligner.servers.batching import check_batch_limits
from nemo_aligner.servers.reward_model_server import RewardModelServer
from nemo_aligner.servers.triton_host import check_ports_free, server_address
from nemo_aligner.utils.distributed import get_rank
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.exp_manager import setup_console_logging
from nemo_aligner.utils.run_setup import init_run


def serve_reward_model(cfg) -> None:
    """``serve_reward_model.py``: load ``rm_model_file`` and serve it until stopped."""
    path = cfg.get("rm_model_file")
    if not path:
        raise ConfigError("rm_model_file is required: the reward-model .nemo to serve")
    inference = cfg.inference
    address = server_address(inference, "inference")
    parallel = init_run(cfg, path, "rm_model_file",
                        timeout_minutes=int(inference.get("dist_timeout_minutes") or 7 * 24 * 60))
    check_batch_limits(inference.get("max_batch_size"), int(inference.get("micro_batch_size") or 4), parallel.dp,
                       "inference.max_batch_size", "inference.micro_batch_size")
    setup_console_logging()
    if get_rank() == 0:
        check_ports_free(address, "inference")
    model = load_model(MegatronGPTRewardModel, cfg.model, cfg.trainer.precision, path, key="rm_model_file",
                       trainable=False)
    model.prepare_for_inference()
    server = RewardModelServer(
        model, address,
        micro_batch_size=int(inference.get("micro_batch_size") or 4),
        max_queue_delay_us=int(inference.get("max_queue_delay_microseconds") or 0),
        strip_to_multiple=inference.get("strip_sequence_length_to_multiple"),
        max_batch_size=inference.get("max_batch_size"),
        workspace_dir=inference.get("workspace_dir"),
        triton_log_file=inference.get("triton_log_file"),
        max_sequence_length=inference.get("max_sequence_length"),
    )
    server.run()
