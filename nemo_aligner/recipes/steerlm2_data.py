"""SteerLM 2.0's training records (the format of NeMo-Aligner's ``SteerLM2Dataset``) from three
models: the SteerLM model Q'(y|a,x) samples ``--num-responses`` responses to each prompt and
attribute string, and scores them; the unconditioned (SFT) model gives log P(y|x); a regression
reward model's attribute predictions give log P(a|x,y) = sum over the asked attributes of
log N(asked value; predicted value, ``--attribute-sigma``). One process; the models are loaded one
after another. Run it again with the trained model as ``--steerlm-model`` for the next iteration."""

from __future__ import annotations

import argparse
import math
from typing import Dict, List, Sequence

import torch

from nemo_aligner.data.nlp.chat_template import chat_tokens
from nemo_aligner.data.nlp.jsonl import read_jsonl, write_jsonl
from nemo_aligner.data.nlp.reward_datasets import texts_to_tokens
from nemo_aligner.data.nlp.steerlm2_dataset import response_prompt
from nemo_aligner.data.nlp.steerlm_labels import model_chat_tokens, parse_label, render_turns
from nemo_aligner.utils.errors import ConfigError, DataError


def log_p_attributes(asked: Dict[str, float], predicted: Dict[str, float], sigma: float) -> float:
    """``sum_k log N(asked_k; predicted_k, sigma)`` over the asked attributes."""
    return sum(-0.5 * ((asked[k] - predicted[k]) / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi))
               for k in asked)


def prompt_records(records: List[Dict], labels: Sequence[str], where: str) -> List[Dict]:
    """``{"system", "prompt_turns", "label"}`` per input record (``prompt_turns``, or a ``prompt``,
    ``input`` or ``text`` string), once per ``labels`` entry when given, else with the record's own ``label``."""
    out = []
    for r in records:
        at = f"{where}:{r.get('__line__', '?')}"
        if isinstance(r.get("prompt_turns"), list):
            turns = r["prompt_turns"]
        elif any(isinstance(r.get(k), str) for k in ("prompt", "input", "text")):
            turns = [{"from": "User", "value": next(r[k] for k in ("prompt", "input", "text") if isinstance(r.get(k), str))}]
        else:
            raise DataError(f"{at}: needs prompt_turns (a list of turns) or prompt (a string)")
        for label in labels or [r.get("label")]:
            if not isinstance(label, str) or not label:
                raise DataError(f"{at}: no label (attribute string, e.g. quality:4) and no --labels given")
            parse_label(label, at)
            out.append({"system": r.get("system") or "", "prompt_turns": turns, "label": label})
    return out


def check_reward_model(path: str, prompts: List[Dict]) -> List[str]:
    """The regression reward model's attribute names (from its config, before any model is loaded);
    a model of another kind, or a label asking for an attribute it does not predict, is an error."""
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import regression_attribute_names
    from nemo_aligner.utils.nemo_file import read_model_config

    cfg = read_model_config(path, "--reward-model")
    regression = cfg.get("regression") or {}
    if cfg.get("reward_model_type") != "regression" or regression.get("merge_attributes", False):
        raise ConfigError(f"--reward-model {path}: needs a regression reward model with one output per attribute "
                          f"(this one: reward_model_type={cfg.get('reward_model_type')}, "
                          f"merge_attributes={regression.get('merge_attributes', False)})")
    names = regression_attribute_names(cfg)
    for p in prompts:
        unknown = sorted(set(parse_label(p["label"])) - set(names))
        if unknown:
            raise DataError(f"label {p['label']!r}: {unknown} not among the reward model's attributes {names}")
    return names


@torch.no_grad()
def response_logprobs(model, prompts: Sequence[List[int]], responses: Sequence[List[int]], batch_size: int) -> List[float]:
    """``log p(response | prompt)`` (summed over the response's tokens) of each pair, by ``model``."""
    from nemo_aligner.data.nlp.sft_dataset import collate_sft

    model.eval()
    out: List[float] = []
    for start in range(0, len(prompts), batch_size):
        samples = [{"input_ids": p + r, "answer_start": len(p)} for p, r in
                   zip(prompts[start:start + batch_size], responses[start:start + batch_size])]
        batch = collate_sft(samples, model.tokenizer.eos_id, max(len(s["input_ids"]) for s in samples), 1)
        data = {k: batch[k] for k in ("tokens", "labels", "position_ids")}
        ce = torch.cat([o.float().cpu() for o in model.forward_backward(data, None, True, len(samples))])
        out += (-(ce * batch["loss_mask"]).sum(-1)).tolist()
    return out


def main(argv=None) -> None:
    from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.models.nlp.gpt.text_generation import generate_texts
    from nemo_aligner.utils import distributed as D
    from omegaconf import OmegaConf

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-file", required=True, help="jsonl of {prompt_turns | prompt, system?, label?}")
    parser.add_argument("--output-file", required=True)
    parser.add_argument("--steerlm-model", required=True, help="Q'(y|a,x): the SteerLM .nemo that samples")
    parser.add_argument("--sft-model", required=True, help="P(y|x): the unconditioned .nemo")
    parser.add_argument("--reward-model", required=True, help="P(a|x,y): a regression reward model .nemo")
    parser.add_argument("--labels", default=None,
                        help="';'-separated attribute strings asked of every prompt (default: each record's label)")
    parser.add_argument("--num-responses", type=int, default=4)
    parser.add_argument("--attribute-sigma", type=float, default=1.0)
    parser.add_argument("--sft-format", choices=("chat", "plain"), default="chat",
                        help="how the SFT model reads a prompt: NeMo's chat template, or '<prompt> <response><eos>'")
    parser.add_argument("--rm-format", choices=("chat", "plain"), default="chat",
                        help="what the reward model scores: the chat without labels, or '<prompt> <response>'")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    for name in ("num_responses", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.attribute_sigma > 0 or not args.temperature > 0:
        raise ConfigError("--attribute-sigma and --temperature must be > 0")
    labels = [x.strip() for x in args.labels.split(";") if x.strip()] if args.labels else []
    prompts = prompt_records(read_jsonl(args.input_file), labels, args.input_file)
    names = check_reward_model(args.reward_model, prompts)

    D.init_distributed()
    D.initialize_model_parallel(1, 1, seed=args.seed)
    try:
        # 1. Q': sample, then score the exact training rows (response + end of turn + next turn start)
        policy = load_model(MegatronGPTModel, OmegaConf.create({}), "32", args.steerlm_model, key="--steerlm-model",
                            trainable=False)
        tokens = model_chat_tokens(policy.cfg)
        t = chat_tokens(tokens)
        steer = [response_prompt(p["system"], p["prompt_turns"], label=p["label"], tokens=tokens) for p in prompts]
        repeated = [s for s in steer for _ in range(args.num_responses)]
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, end_strings=[t["end_of_turn"]])
        values = generate_texts(policy, repeated, sampling, LengthParams(max_length=args.max_new_tokens, min_length=0),
                                seed=args.seed, batch_size=args.batch_size)
        tok = policy.tokenizer
        rows = [tok.text_to_ids(v + t["end_of_turn"] + t["turn_start"]) for v in values]
        log_q = response_logprobs(policy, [tok.text_to_ids(s) for s in repeated], rows, args.batch_size)
        del policy
        # 2. P(y|x) by the unconditioned model
        sft = load_model(MegatronGPTModel, OmegaConf.create({}), "32", args.sft_model, key="--sft-model", trainable=False)
        user = [p["prompt_turns"][-1]["value"] for p in prompts for _ in range(args.num_responses)]
        if args.sft_format == "plain":
            sft_prompts = [sft.tokenizer.text_to_ids(u + " ") for u in user]
            sft_rows = [sft.tokenizer.text_to_ids(v) + [sft.tokenizer.eos_id] for v in values]
        else:
            heads = [response_prompt(p["system"], p["prompt_turns"], tokens=tokens)
                     for p in prompts for _ in range(args.num_responses)]
            sft_prompts = [sft.tokenizer.text_to_ids(h) for h in heads]
            sft_rows = [sft.tokenizer.text_to_ids(v + t["end_of_turn"] + t["turn_start"]) for v in values]
        log_py = response_logprobs(sft, sft_prompts, sft_rows, args.batch_size)
        del sft
        # 3. P(a|x,y) from the regression reward model's attribute predictions
        rm = load_model(MegatronGPTRewardModel, OmegaConf.create({}), "32", args.reward_model, key="--reward-model",
                        trainable=False)
        if args.rm_format == "plain":
            texts = [f"{u} {v}" for u, v in zip(user, values)]
        else:
            texts = [render_turns(p["system"], p["prompt_turns"] + [{"from": "Assistant", "value": v}], tokens,
                                  with_labels=False)
                     for p, v in zip((p for p in prompts for _ in range(args.num_responses)), values)]
        # tokenized as the reward model's training and server do: its EOS (model.data.append_eod) and its
        # last seq_length tokens
        rm_data = rm.cfg.get("data") or {}
        rm_seq = int(rm_data.get("seq_length") or rm.cfg.encoder_seq_length)
        predicted: List[List[float]] = []
        rm.prepare_for_inference()
        for start in range(0, len(texts), args.batch_size):
            tokens, lengths = texts_to_tokens(rm.tokenizer, texts[start:start + args.batch_size], rm_seq,
                                              add_eos=bool(rm_data.get("append_eod", True)))
            out = rm.infer(torch.from_numpy(tokens), torch.from_numpy(lengths))
            predicted += out.reshape(len(tokens), -1).tolist()
    finally:
        D.destroy()
    records, k = [], 0
    for p in prompts:
        asked = parse_label(p["label"])
        responses = []
        for _ in range(args.num_responses):
            pred = dict(zip(names, predicted[k]))
            responses.append({"from": "Assistant", "value": values[k],
                              "log(P(a|x,y))": log_p_attributes(asked, pred, args.attribute_sigma),
                              "log(P(y|x))": log_py[k], "log(Q(y|a,x))": log_q[k],
                              "predicted_attributes": {n: round(v, 4) for n, v in pred.items()}})
            k += 1
        records.append({**p, "responses": responses})
    write_jsonl(args.output_file, records)
    print(f"SteerLM 2.0 records: {len(records)} prompts x {args.num_responses} responses written to "
          f"{args.output_file}", flush=True)
