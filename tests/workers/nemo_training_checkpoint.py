"""Write a training checkpoint directory as NeMo(-Aligner) writes one (NLPDDPStrategy.save_checkpoint
with distributed checkpointing): a torch_dist directory whose tensors are the model's megatron-core
names under ``model.`` (Transformer Engine's fused norm names with ``--te``, its per-layer
``_extra_state``), the optimizer's under ``optimizer.state.*``, and a ``common.pt`` holding
Lightning's entries (the model config as OmegaConf objects, loops, callbacks, schedulers).

    python nemo_training_checkpoint.py --nemo base.nemo [--weights <our checkpoint dir>] [--perturb]
        [--te] [--scheduler-steps N] --out <dir> [--save-nemo ref.nemo]
"""

import argparse
import dataclasses
import os

import torch
from omegaconf import OmegaConf

TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nemo", required=True, help="the architecture and tokenizer (and weights unless --weights)")
    parser.add_argument("--weights", default=None, help="a training checkpoint of ours to take the weights from")
    parser.add_argument("--perturb", action="store_true", help="add noise: weights unlike the .nemo's")
    parser.add_argument("--te", action="store_true", help="Transformer Engine's tensor names")
    parser.add_argument("--scheduler-steps", type=int, default=None, help="the saved scheduler's last_epoch")
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-nemo", default=None, help="also write the same weights as a .nemo")
    args = parser.parse_args()

    from nemo_aligner.utils import distributed as D

    D.init_distributed()
    D.initialize_model_parallel(1, 1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import read_model_config, save_nemo

    model = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 1}), "32", args.nemo, trainable=False)
    if args.weights:
        model.load_weights(args.weights)
    if args.perturb:
        torch.manual_seed(0)
        with torch.no_grad():
            for param in model.module.parameters():
                param.add_(0.05 * torch.randn_like(param))
    if args.save_nemo:
        save_nemo(model, args.save_nemo)

    model_sd, opt_state = {}, {}
    for index, (key, entry) in enumerate(model.sharded_state_dict().items()):
        if args.te:
            for local, te in TE_NORMS.items():
                entry.key = entry.key.replace(local, te)
        model_sd[key] = entry
        if isinstance(entry, ShardedTensor):  # Adam's moments under NeMo's optimizer names
            opt_state[index] = {name: dataclasses.replace(entry, key=f"optimizer.state.{name}.{entry.key}",
                                                          data=torch.full_like(entry.data, 0.5))
                                for name in ("exp_avg", "exp_avg_sq")}
    if args.te:  # TE's attention keeps FP8 metadata per layer
        key = "model.decoder.layers.self_attention.core_attention._extra_state"
        model_sd[key] = ShardedObject(key, torch.zeros(4, dtype=torch.uint8), (1,), (0,), replica_id=0)

    cfg = OmegaConf.create(read_model_config(args.nemo))
    cfg.tokenizer.model = "/tmp/tmpgone1234/a1b2_tokenizer.model"  # NeMo's hparams point at extracted files
    cfg.restore_from_path = os.path.abspath(args.nemo)  # NeMo-Aligner's SFT model config names its start
    steps = args.scheduler_steps
    checkpoint = {
        "epoch": 0, "global_step": 0, "pytorch-lightning_version": "2.4.0", "state_dict": {},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.state_dict": {"_batches_that_stepped": 0}}},
        "callbacks": {"NeMoModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {
            "monitor": "val_loss", "best_model_score": torch.tensor(1.25), "best_model_path": "",
            "best_k_models": {}, "kth_value": torch.tensor(float("inf")), "dirpath": os.path.dirname(args.out)}},
        "optimizer_states": [{"optimizer": {"state": opt_state, "param_groups": [
            {"lr": 1e-4, "betas": (0.9, 0.98), "weight_decay": 0.01, "params": sorted(opt_state)}]},
            "fp32_from_fp16_params": []}],
        "lr_schedulers": [] if steps is None else [
            {"last_epoch": steps, "_step_count": steps + 1, "base_lrs": [1e-4], "_last_lr": [1e-4],
             "max_steps": 100, "warmup_steps": 0}],
        "hparams_name": "cfg", "hyper_parameters": {"cfg": cfg},
        "sharded_state_dict": model_sd,
    }
    os.makedirs(args.out, exist_ok=True)
    dist_checkpointing.save(checkpoint, args.out)


if __name__ == "__main__":
    main()
