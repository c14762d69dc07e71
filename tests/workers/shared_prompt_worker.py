"""Under torchrun at a given TP/PP (or alone): an actor's log-probs, GRPO loss and gradient norm on
fixed rollouts, unpacked and packed by prompt. Rank 0 writes both as JSON.

    python shared_prompt_worker.py --tp 2 --pp 1 --arch '{...}' --out result.json
"""

import argparse
import json

import torch
from omegaconf import OmegaConf


def fixed_rollouts(vocab: int, width: int = 24):
    """Three groups (3, 3 and 2 rows) with prompts and responses of different lengths."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (7, 3, 5)]
    rows = [(0, 9), (0, 4), (0, 12), (1, 6), (1, 1), (1, 10), (2, 8), (2, 3)]
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    prompt_lengths, response_lengths = [], []
    for b, (group, r) in enumerate(rows):
        p = prompts[group]
        tokens[b, : len(p)] = torch.tensor(p)
        tokens[b, len(p) : len(p) + r] = torch.randint(1, vocab, (r,), generator=g)
        prompt_lengths.append(len(p))
        response_lengths.append(len(p) + r)
    return tokens, torch.tensor(prompt_lengths), torch.tensor(response_lengths)


def build_actor(arch: dict, precision: str = "32"):
    """A GRPO actor with random weights moved away from its initial policy (a non-zero KL term)."""
    from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(0)
    cfg = OmegaConf.create(dict(
        arch, micro_batch_size=4, global_batch_size=8, encoder_seq_length=32,
        grpo={"forward_micro_batch_size": 4, "reference_policy_kl_penalty": 0.1, "entropy_bonus": 0.01},
        optim={"name": "fused_adam", "lr": 1e-3, "weight_decay": 0.0, "sched": {"name": "Constant"}}))
    model = MegatronGPTActorModel(cfg, ByteTokenizer(), precision=precision, section="grpo")
    model.setup_optimization(max_steps=10, clip_grad=1.0)
    model.snapshot_initial_policy()
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def packed_and_unpacked(model) -> dict:
    """Log-probs (masked), reference log-probs, loss, KL term, entropy and gradient norm on
    :func:`fixed_rollouts`, without and with the rows' lengths (which let the actor pack them)."""
    from megatron.core import parallel_state

    from nemo_aligner.utils.ppo_utils import create_mask

    tokens, prompt_lengths, response_lengths = fixed_rollouts(vocab=250)
    mask = create_mask(prompt_lengths, response_lengths, tokens.shape[1] - 1)
    advantages = torch.linspace(-1, 1, tokens.shape[0]).unsqueeze(1) * mask
    results = {"sharing": model.share_prompt_prefix}
    for name, lengths in (("unpacked", (None, None)), ("packed", (prompt_lengths, response_lengths))):
        model.eval()
        logprobs = model.get_logprobs(tokens, *lengths)
        init = model.get_init_policy_logprobs(tokens, *lengths)
        model.train()
        batch = {"tokens": tokens, "logprobs": None, "init_logprobs": init, "advantages": advantages, "mask": mask,
                 "is_end": torch.ones(tokens.shape[0], dtype=torch.bool)}
        if lengths[0] is not None:
            batch.update(prompt_lengths=prompt_lengths, response_lengths=response_lengths)
        model.prepare_for_training_step()
        loss, metrics = model.get_loss_and_metrics(batch, forward_only=False)
        local = torch.stack([p.main_grad.double().pow(2).sum() for p in model.module.parameters()]).sum()
        # Over the model-parallel group, each rank holding its shard (replicated ones counted on each:
        # the same in both runs).
        torch.distributed.all_reduce(local, group=parallel_state.get_model_parallel_group())
        results[name] = {"logprobs": (logprobs * mask).tolist(), "init_logprobs": (init * mask).tolist(),
                         "loss": loss, "kl_loss": metrics["kl_loss"], "entropy": metrics["entropy"],
                         "grad_norm": float(local.sqrt())}
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--arch", required=True, help="JSON model keys")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from nemo_aligner.utils import distributed as D

    D.init_distributed()
    D.initialize_model_parallel(args.tp, args.pp, seed=1234)
    results = packed_and_unpacked(build_actor(json.loads(args.arch)))
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    D.destroy()


if __name__ == "__main__":
    main()
