"""RL Constitutional AI data (RLAIF): responses at several temperatures from a served model, the most
and least harmless picked by a judge under the constitution, written as reward-model comparisons, PPO
prompts and DPO pairs per split (NeMo-Aligner's ``generate_rl_cai_dataset.py`` command line; docs/cai.md).

    python examples/nlp/gpt/generate_gpt.py gpt_model_file=sl_cai.nemo server=True port=5999 &
    python examples/nlp/cai/generate_rl_cai_dataset.py --batch-size 32 \\
        --red-teaming-file-path red_team.jsonl \\
        --sys-prompt-constitution-file-path examples/nlp/cai/sys_prompt_constitution \\
        --output-dir rl_cai --output-filename-prefix cai_preference_dataset --port 5999

The judge is an OpenAI-compatible chat endpoint with ``--ngc-api-key`` (``--ngc-url``, ``--ngc-model``),
else the served model (or ``--judge-host``/``--judge-port``), choosing by the log-probability it gives
each response number.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cai_args import EXTRA_ID_TEMPLATE, add_inference_args, add_template_args, literal, settings, template  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output-dir", default=".")
    parser.add_argument("--output-filename-prefix", default="cai_rlaif")
    parser.add_argument("--splits", default="{'train': 0.8, 'test': 0.2}")
    parser.add_argument("--shuffle", choices=["True", "False", "true", "false"], default="True")
    parser.add_argument("--red-teaming-file-path", required=True)
    parser.add_argument("--sys-prompt-constitution-file-path", required=True)
    parser.add_argument("--blend-with", default=None,
                        help="{'name': ..., '<split>': {'prompts': [...], 'comparisons': [...]}} per split")
    parser.add_argument("--num-examples", type=int, default=-1, help="prompts to use (-1: all)")
    parser.add_argument("--temperatures", default="[0.01, 0.51, 1.01, 1.51]", help="one response per temperature")
    group = parser.add_argument_group("judge")
    group.add_argument("--ngc-api-key", default=None, help="an OpenAI-compatible chat endpoint's key (NGC)")
    group.add_argument("--ngc-url", default="https://integrate.api.nvidia.com/v1/chat/completions")
    group.add_argument("--ngc-model", default="mistralai/mixtral-8x7b-instruct-v0.1")
    group.add_argument("--judge-host", default=None, help="without --ngc-api-key: the judge's text generation "
                                                           "server (default: --host)")
    group.add_argument("--judge-port", type=int, default=None, help="(default: --port)")
    add_inference_args(parser, greedy="False", top_k=50, top_p=0.95, end_strings=["<extra_id_1>"], port=5656)
    add_template_args(parser, **EXTRA_ID_TEMPLATE)
    args = parser.parse_args(argv)

    from nemo_aligner.recipes import cai
    from nemo_aligner.servers.clients import TextGenerationClient
    from nemo_aligner.utils.errors import DataError
    from nemo_aligner.utils.hydra_runner import run_cli

    def run():
        splits = literal(args.splits, "splits")
        blend = literal(args.blend_with, "blend-with") if args.blend_with else None
        if blend is not None and (not isinstance(blend, dict) or any(s not in blend for s in splits)):
            raise SystemExit("error: --blend-with needs an entry for every split of --splits")
        temperatures = [float(t) for t in literal(args.temperatures, "temperatures")]
        if len(temperatures) < 2:
            raise SystemExit("error: --temperatures needs two or more values: the judge picks among the responses")
        with open(args.sys_prompt_constitution_file_path, encoding="utf-8") as f:
            constitution = f.read()
        prompts = cai.read_red_team_prompts(args.red_teaming_file_path)
        if args.num_examples > 0:
            prompts = prompts[: args.num_examples]
        chat = template(args)
        client = TextGenerationClient(args.host, args.port, "--host/--port", timeout_s=args.timeout)
        candidates = cai.generate_rl_candidates(client, prompts, chat, settings(args), max(args.batch_size, 1),
                                                temperatures)
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "cai_candidate_dataset.json"), "w", encoding="utf-8") as f:
            json.dump(candidates, f, indent=2)
        if args.ngc_api_key:
            def choose(prompt, responses):
                return cai.judge_by_chat(args.ngc_api_key, args.ngc_url, args.ngc_model, constitution, prompt,
                                         responses, args.seed)
        else:
            judge = client if args.judge_host is None and args.judge_port is None else TextGenerationClient(
                args.judge_host or args.host, args.judge_port or args.port, "--judge-host/--judge-port",
                timeout_s=args.timeout)

            def choose(prompt, responses):
                return cai.judge_by_logprobs(judge, chat, constitution, prompt, responses)
        preferences = cai.preference_records(candidates, choose)
        with open(os.path.join(args.output_dir, "cai_preference_dataset.json"), "w", encoding="utf-8") as f:
            json.dump(preferences, f, indent=2)
        if not preferences:
            raise DataError("the judge decided no candidate set (or every chosen response equals its rejected one); "
                            "nothing to write")
        by_split = cai.split_records(preferences, splits, args.shuffle.lower() == "true", args.seed)
        written = cai.write_rl_cai(by_split, chat, args.output_dir, args.output_filename_prefix, blend, args.seed)
        print(f"RL-CAI: {len(preferences)} AI preferences from {len(candidates)} prompts; "
              + "; ".join(f"{s}: {len(by_split[s])} pairs -> {p['comparisons']}" for s, p in written.items()),
              flush=True)
    run_cli(run)


if __name__ == "__main__":
    main()
