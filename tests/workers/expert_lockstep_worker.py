"""The actor (and SPIN's model) of a mixture-of-experts .nemo under torchrun with its experts split over the ranks
(``--ep 2``), or alone holding every expert (``--ep 1``, which plays every rank's part in turn).

Each data-parallel rank runs its own generation calls (different numbers of calls, prompts and
lengths, so its rows stop at other steps than its peer's), then the initial-policy log-probs (a
weight swap: the current policy's experts are negated), then the current log-probs. Rank 0 writes
every rank's tokens and log-probs as JSON.

    python expert_lockstep_worker.py --nemo moe.nemo --ep 2 --out result.json [--roles actor,spin,uneven]

``spin``: SPIN's model, whose generation calls (as many on every rank) each swap the reference
policy's weights in and out; its tokens are written under "spin", the actor's under "actor".

``uneven``: the actor again, its ranks then asking for log-probs of different numbers of
micro-batches; the error a rank gets is written in place of the role's parts (by every rank: rank
r > 0 to ``<out>.<r>``).
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
# SPIN's generation calls (the reference policy's weights swapped in and out per call): as many on
# every rank, with other lengths.
SPIN_PLANS = [
    [(["reverse abcdef = ", "sort hgfedcba = ", "reverse ab = ", "sort cab = "], 12, False),
     (["reverse hhgg = ", "sort bdca = "], 3, True)],
    [(["sort ba = ", "reverse gfedcb = ", "reverse c = "], 3, False),
     (["sort fed = ", "reverse abcd = "], 12, False)],
]


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


def spin_part(model, plan, rank: int):
    """One rank's SPIN generation calls (the reference policy answers) as token lists."""
    from nemo_aligner.models.alignable_interface import LengthParams, SamplingParams

    tok = model.tokenizer
    model.prepare_for_inference()
    tokens = []
    for index, (prompts, max_length, sampled) in enumerate(plan):
        out = model.infer([tok.text_to_ids(p) for p in prompts], seed=100 * rank + index,
                          sampling=SamplingParams(use_greedy=not sampled, temperature=1.0),
                          length=LengthParams(max_length=max_length))
        tokens += [out.tokens[b, : int(out.response_lengths[b])].tolist() for b in range(out.tokens.shape[0])]
    model.finish_inference()
    return {"tokens": tokens}


def role_parts(role: str, nemo: str, uneven: bool):
    """Every rank's part (one process: each rank's in turn) for ``role`` (actor or spin); on a
    RuntimeError this rank's message (a string) instead."""
    from megatron.core import parallel_state

    from nemo_aligner.models.nlp.gpt.expert_lockstep import is_moe_layer
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
    from nemo_aligner.models.nlp.gpt.megatron_gpt_spin_model import MegatronGPTSPINModel

    cfg = OmegaConf.create({"micro_batch_size": 1, "encoder_seq_length": 64,
                            "ppo": {"forward_micro_batch_size": LOGPROB_ROWS, "rollout_micro_batch_size": 4},
                            "spin": {"rollout_micro_batch_size": 4, "length_params": {"max_length": 12}}})
    if role == "spin":
        model = load_model(MegatronGPTSPINModel, cfg, "32", nemo, trainable=False)
        model.snapshot_reference_policy()
        plans, part = SPIN_PLANS, lambda rank: spin_part(model, SPIN_PLANS[rank], rank)
    else:
        model = load_model(MegatronGPTActorModel, cfg, "32", nemo, trainable=False)
        model.snapshot_initial_policy()
        plans, part = PLANS, lambda rank: rank_part(model, PLANS[rank], rank, uneven)
    # The initial (reference) policy is the checkpoint; the current one has its experts' outputs
    # negated, so a token meeting the wrong policy's experts changes what is generated or scored.
    with torch.no_grad():
        for layer in model.module.decoder.layers:
            if is_moe_layer(layer.mlp):
                for name, param in layer.mlp.experts.named_parameters():
                    if "linear_fc2" in name:
                        param.neg_()
    world = torch.distributed.get_world_size()
    if world == 1:
        return [part(rank) for rank in range(len(plans))]
    try:
        mine = part(parallel_state.get_data_parallel_rank())
    except RuntimeError as err:
        return str(err)
    parts = [None] * world
    torch.distributed.all_gather_object(parts, mine)
    return parts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nemo", required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--roles", default="actor,spin")
    args = parser.parse_args()

    from nemo_aligner.utils import distributed as D

    D.init_distributed()
    D.initialize_model_parallel(1, 1, seed=1234, ep=args.ep)
    result = {role: role_parts("actor" if role == "uneven" else role, args.nemo, role == "uneven")
              for role in args.roles.split(",")}
    rank = torch.distributed.get_rank()
    if rank == 0 or "uneven" in result:
        with open(args.out if rank == 0 else f"{args.out}.{rank}", "w") as f:
            json.dump(result, f)
    D.destroy()


if __name__ == "__main__":
    main()
