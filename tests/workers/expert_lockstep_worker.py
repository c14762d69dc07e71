"""The actor of a mixture-of-experts .nemo under torchrun with its experts split over the ranks
(``--ep 2``), or alone holding every expert (``--ep 1``, which plays every rank's part in turn).

Each data-parallel rank runs its own generation calls (different numbers of calls, prompts and
lengths, so its rows stop at other steps than its peer's), then the initial-policy log-probs (a
weight swap: the current policy's experts are negated), then the current log-probs. Rank 0 writes
every rank's tokens and log-probs as JSON.

    python expert_lockstep_worker.py --nemo moe.nemo --ep 2 --out result.json [--uneven]

``--uneven``: the ranks then ask for log-probs of different numbers of micro-batches; each rank
writes the error it gets to ``<out>.<rank>``.
"""

import argparse
import json

import torch
from omegaconf import OmegaConf

# Each rank's generation calls: (prompts, max_length, sampled?) over the built-in task's prompts.
PLANS = [
    [(["reverse abcdef = ", "sort hgfedcba = ", "reverse ab = ", "sort cab = "], 12, False),
     (["reverse hhgg = ", "sort bdca = "], 6, True)],
    [(["sort ba = ", "reverse gfedcb = ", "reverse c = "], 3, False)],
]
LOGPROB_ROWS = 3  # the first rows of each rank's rollouts: one micro-batch of 3 on every rank


def rank_part(model, plan, rank: int, uneven: bool):
    """One rank's rollouts and log-probs (as lists)."""
    from nemo_aligner.models.alignable_interface import LengthParams, SamplingParams
    from nemo_aligner.data.nlp.dpo_dataset import pad_rows

    tok = model.tokenizer
    model.prepare_for_inference()
    rows, tokens = [], []
    for index, (prompts, max_length, sampled) in enumerate(plan):
        sampling = SamplingParams(use_greedy=not sampled, temperature=1.0)
        out = model.infer([tok.text_to_ids(p) for p in prompts], seed=100 * rank + index, sampling=sampling,
                          length=LengthParams(max_length=max_length))
        for b in range(out.tokens.shape[0]):
            ids = out.tokens[b, : int(out.response_lengths[b])].tolist()
            rows.append(ids)
            tokens.append(ids)
    count = LOGPROB_ROWS + (1 if uneven and rank == 0 else 0)  # 4 rows: 4 micro-batches of 1
    batch = pad_rows(rows[:count], max(len(r) for r in rows[:count]), tok.eos_id)
    init = model.get_init_policy_logprobs(batch)
    current = model.get_logprobs(batch)
    model.finish_inference()
    return {"tokens": tokens, "init_logprobs": init.tolist(), "logprobs": current.tolist()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nemo", required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--uneven", action="store_true")
    args = parser.parse_args()

    from megatron.core import parallel_state

    from nemo_aligner.models.nlp.gpt.expert_lockstep import is_moe_layer
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
    from nemo_aligner.utils import distributed as D

    D.init_distributed()
    D.initialize_model_parallel(1, 1, seed=1234, ep=args.ep)
    cfg = OmegaConf.create({"micro_batch_size": 1, "encoder_seq_length": 64,
                            "ppo": {"forward_micro_batch_size": LOGPROB_ROWS, "rollout_micro_batch_size": 4}})
    model = load_model(MegatronGPTActorModel, cfg, "32", args.nemo, trainable=False)
    # The initial policy is the checkpoint; the current one has its experts' outputs negated, so a
    # token meeting the wrong policy's experts changes what is generated or scored.
    model.snapshot_initial_policy()
    with torch.no_grad():
        for layer in model.module.decoder.layers:
            if is_moe_layer(layer.mlp):
                for name, param in layer.mlp.experts.named_parameters():
                    if "linear_fc2" in name:
                        param.neg_()
    world = torch.distributed.get_world_size()
    if world == 1:
        parts = [rank_part(model, plan, rank, False) for rank, plan in enumerate(PLANS)]
    else:
        rank = parallel_state.get_data_parallel_rank()
        try:
            mine = rank_part(model, PLANS[rank], rank, args.uneven)
        except RuntimeError as err:
            with open(f"{args.out}.{rank}", "w") as f:
                f.write(str(err))
            D.destroy()
            return
        parts = [None] * world
        torch.distributed.all_gather_object(parts, mine)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(parts, f)
    D.destroy()


if __name__ == "__main__":
    main()
