"""Load a .nemo at a given TP/PP under torchrun (or alone), compute the SFT loss on a fixed
batch, take one optimizer step, compute it again; optionally save a .nemo. Rank 0 writes JSON.

    python parallel_loss_worker.py --nemo in.nemo --tp 2 --pp 1 [--ep 2] --out result.json [--save out.nemo]
"""

import argparse
import json

import torch
from omegaconf import OmegaConf


def fixed_batch(tokenizer, n: int, seq: int):
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask
    from nemo_aligner.data.nlp.sft_dataset import GPTSFTDataset, collate_sft

    records = [dict(r, __line__=i + 1) for i, r in enumerate(BuiltinTask(seed=7).sft_records(n, "fixed"))]
    ds = GPTSFTDataset("fixed", tokenizer, seq, records=records)
    return collate_sft([ds[i] for i in range(n)], tokenizer.eos_id, seq)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nemo", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (a mixture-of-experts model)")
    parser.add_argument("--ragged", action="store_true",
                        help="cut each rank's rows to their own longest: ranks hold different token counts")
    parser.add_argument("--aux-loss", type=float, default=None, help="model.moe_aux_loss_coeff")
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--optim", default="fused_adam")
    parser.add_argument("--out", required=True)
    parser.add_argument("--save", default=None)
    parser.add_argument("--random-arch", default=None, help="JSON model keys: build from random weights")
    parser.add_argument("--lora", default=None, help="LoRA target_modules (e.g. mlp): train adapters only")
    parser.add_argument("--lora-variant", default="nemo", help="model.peft.lora_tuning.variant")
    parser.add_argument("--lora-restore", default=None, help="an adapters-only .nemo to start the adapters from")
    parser.add_argument("--seed", type=int, default=None, help="model.seed (the adapters' initialisation)")
    args = parser.parse_args()

    from megatron.core import parallel_state

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils import distributed as D

    D.init_distributed()
    D.initialize_model_parallel(args.tp, args.pp, seed=1234, ep=args.ep)
    cfg = OmegaConf.create({
        "micro_batch_size": args.mbs, "encoder_seq_length": 32,
        "optim": {"name": args.optim, "lr": 1e-2, "weight_decay": 0.0, "betas": [0.9, 0.98],
                  "sched": {"name": "Constant"}},
    })
    if args.aux_loss is not None:
        cfg.moe_aux_loss_coeff = args.aux_loss
    if args.random_arch:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(json.loads(args.random_arch)))
    if args.lora:
        cfg.peft = {"peft_scheme": "lora", "restore_from_path": args.lora_restore,
                    "lora_tuning": {"target_modules": [args.lora], "adapter_dim": 4, "alpha": 8,
                                    "row_init_method": "normal", "variant": args.lora_variant}}
    if args.seed is not None:
        cfg.seed = args.seed
    model = load_model(GPTSFTModel, cfg, "32", None if args.random_arch else args.nemo)
    if args.save:
        from nemo_aligner.utils.nemo_file import save_nemo

        save_nemo(model, args.save)
    optimizer, scheduler = model.setup_optimization(max_steps=10, clip_grad=1.0)
    batch = fixed_batch(model.tokenizer, args.gbs, 32)
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    local = args.gbs // dp
    batch = {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}
    if args.ragged:
        longest = int(batch["lengths"].max())
        batch = {k: v[:, :longest] if k in ("tokens", "labels", "loss_mask", "position_ids") else v
                 for k, v in batch.items()}
    with torch.no_grad():
        model.eval()
        loss0, metrics0 = model.get_loss_and_metrics(batch, forward_only=True)
    model.prepare_for_training_step()
    loss_train, _ = model.get_loss_and_metrics(batch, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    with torch.no_grad():
        model.eval()
        loss1, _ = model.get_loss_and_metrics(batch, forward_only=True)
    params = model.num_parameters()
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"loss0": loss0, "token_loss0": metrics0["token_loss"], "loss_train": loss_train,
                       "grad_norm": float(grad_norm), "loss1": loss1, "dp": dp,
                       "params": params}, f)
    D.destroy()


if __name__ == "__main__":
    main()
