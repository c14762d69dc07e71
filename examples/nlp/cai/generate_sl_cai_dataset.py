"""Supervised Constitutional AI data: critique-revision SFT records from a served model (NeMo-Aligner's
``generate_sl_cai_dataset.py`` command line; docs/cai.md).

    python examples/nlp/gpt/generate_gpt.py gpt_model_file=helpful.nemo server=True port=5999 &
    python examples/nlp/cai/generate_sl_cai_dataset.py \\
        --red-teaming-prompts-dataset-path red_team.jsonl \\
        --few-shot-prompts-dataset-path examples/nlp/cai/few_shot_samples_example.json \\
        --critique-revision-instructions-path examples/nlp/cai/CritiqueRevisionInstructions.json \\
        --output-filepath sl_cai.jsonl --port 5999 --user_format "..." --assistant_format "..."
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cai_args import add_inference_args, add_template_args, settings, template  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--red-teaming-prompts-dataset-path", required=True)
    parser.add_argument("--few-shot-prompts-dataset-path", default=None)
    parser.add_argument("--critique-revision-instructions-path", required=True)
    parser.add_argument("--helpfulness-dataset-path", default=None, help="chat SFT records blended with the revisions")
    parser.add_argument("--output-filepath", required=True)
    parser.add_argument("--num-examples", type=int, default=-1, help="prompts to use (-1: all)")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--system-message", default="", help="the system turn of the written SFT records")
    for name in ("--max-seq-length", "--tokenizer-model", "--tokenizer-library", "--save-to-file-interval"):
        parser.add_argument(name, default=None, help="accepted for NeMo-Aligner's command; SFT truncates long records")
    parser.add_argument("--apply_chat_template", choices=["True", "False"], default="True",
                        help="accepted: turns are always formatted with the --*_format template here")
    add_inference_args(parser, greedy="True", top_k=1, top_p=0.9, end_strings=None, port=5656)
    add_template_args(parser, response_extract_pattern="[/INST]")
    args = parser.parse_args(argv)

    from nemo_aligner.recipes import cai
    from nemo_aligner.servers.clients import TextGenerationClient
    from nemo_aligner.utils.hydra_runner import run_cli

    def run():
        prompts = cai.read_red_team_prompts(args.red_teaming_prompts_dataset_path)
        if args.num_examples > 0:
            prompts = prompts[: args.num_examples]
        client = TextGenerationClient(args.host, args.port, "--host/--port", timeout_s=args.timeout)
        samples = cai.generate_sl_cai(client, prompts, cai.read_instructions(args.critique_revision_instructions_path),
                                      cai.read_few_shot(args.few_shot_prompts_dataset_path), template(args),
                                      settings(args), max(args.batch_size, 1), args.seed)
        summary = cai.write_sl_cai(samples, args.output_filepath, args.helpfulness_dataset_path, args.seed,
                                   args.system_message)
        print(f"SL-CAI: {summary['revisions']} revisions ({summary['records']} records with the helpfulness data) "
              f"written to {summary['output']}", flush=True)
    run_cli(run)


if __name__ == "__main__":
    main()
