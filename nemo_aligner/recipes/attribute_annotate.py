"""Label a NeMo chat jsonl's assistant turns with a served reward model's attribute values
(NeMo-Aligner's ``attribute_annotate.py``), for SteerLM training."""

from __future__ import annotations

import argparse
import json

from nemo_aligner.data.nlp.jsonl import read_jsonl, write_jsonl
from nemo_aligner.data.nlp.steerlm_annotate import annotate_records
from nemo_aligner.data.nlp.steerlm_labels import model_chat_tokens
from nemo_aligner.servers.clients import RemoteGPTRMClient
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.nemo_file import load_tokenizer, read_model_config
from nemo_aligner.utils.tokenizers import ByteTokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-file", required=True, help="NeMo chat jsonl")
    parser.add_argument("--output-file", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5555)
    parser.add_argument("--model-name", default="reward_model")
    parser.add_argument("--attributes", default=None,
                        help="comma-separated names of the server's outputs (default: NeMo's 9 attributes)")
    parser.add_argument("--tokenizer-from", default=None,
                        help="the reward model's .nemo: its tokenizer, context length and chat tokens (default: byte "
                             "tokenizer, no truncation, NeMo's chat tokens)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="keep each text's last N tokens, as reward-model training does (default: the "
                             "--tokenizer-from model's model.data.seq_length or encoder_seq_length)")
    parser.add_argument("--chat-prompt-tokens", default=None,
                        help="JSON object overriding the chat template's special strings, as SFT's "
                             "model.data.chat_prompt_tokens (default: the --tokenizer-from model's, else NeMo's)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--min-value", type=float, default=0)
    parser.add_argument("--max-value", type=float, default=4)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--wait-s", type=float, default=0.0,
                        help="wait this long for a server that is still starting (default: fail at once)")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer_from, "--tokenizer-from") if args.tokenizer_from else ByteTokenizer()
    seq_length, chat_tokens = args.seq_length, None
    if args.tokenizer_from:
        model_cfg = read_model_config(args.tokenizer_from, "--tokenizer-from")
        seq_length = seq_length or (model_cfg.get("data") or {}).get("seq_length") or model_cfg.get("encoder_seq_length")
        chat_tokens = model_chat_tokens(model_cfg)
    if args.chat_prompt_tokens:
        try:
            chat_tokens = json.loads(args.chat_prompt_tokens)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--chat-prompt-tokens is not JSON: {err}") from None
        if not isinstance(chat_tokens, dict):
            raise ConfigError("--chat-prompt-tokens must be a JSON object like {\"turn_start\": \"<extra_id_1>\"}")
    records = read_jsonl(args.input_file)
    names = [n.strip() for n in args.attributes.split(",")] if args.attributes else None
    with RemoteGPTRMClient(args.host, args.port, tokenizer, args.model_name, timeout_s=args.timeout_s,
                           key="--host and --port", wait_s=args.wait_s) as client:
        count = annotate_records(records, client, names, args.batch_size, args.min_value, args.max_value,
                                 chat_tokens=chat_tokens, where=args.input_file,
                                 max_length=int(seq_length) if seq_length else None)
    write_jsonl(args.output_file, ({k: v for k, v in r.items() if not k.startswith("__")} for r in records))
    print(f"labelled {count} assistant turns of {len(records)} conversations: {args.output_file}", flush=True)
