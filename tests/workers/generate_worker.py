"""Generate from a .nemo at a given TP (greedy and seeded sampling); rank 0 writes JSON."""

import argparse
import json

import torch
from omegaconf import OmegaConf


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nemo", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils import distributed as D
    from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams, generate

    D.init_distributed()
    D.initialize_model_parallel(args.tp, args.pp)
    model = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 1}), "32", args.nemo, trainable=False)
    model.eval()
    tok = model.tokenizer
    prompts = [tok.text_to_ids(p) for p in ["reverse abc = ", "sort hgfedcba = ", "x", "reverse abc = "]]
    greedy = generate(model.module, tok, prompts, SamplingParams(use_greedy=True), LengthParams(max_length=8))
    sampled = generate(model.module, tok, prompts, SamplingParams(temperature=1.0, top_k=20), LengthParams(max_length=8),
                       seed=7)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"greedy": greedy.tokens.tolist(), "sampled": sampled.tokens.tolist()}, f)
    D.destroy()


if __name__ == "__main__":
    main()
