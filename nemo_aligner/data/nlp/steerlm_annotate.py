"""Label chat data with SteerLM attributes from a regression reward-model server.

Each Assistant turn's conversation prefix (rendered with the chat template, no labels) is scored
by the ``reward_model`` server; the values, rounded and clipped to ``[min_value, max_value]``,
become the turn's ``label`` (``"quality:4,verbosity:2"``).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Dict, List, Optional, Sequence

import numpy as np

from nemo_aligner.data.nlp.jsonl import read_jsonl, require_fields, write_jsonl
from nemo_aligner.data.nlp.steerlm_labels import NEMO_ATTRIBUTES, assistant_turn_texts, format_label, model_chat_tokens
from nemo_aligner.utils.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


def values_to_label(values: Sequence[float], names: Sequence[str], min_value: float, max_value: float) -> str:
    """Round each value to an integer, clip it to the range and format ``name:value,...``."""
    clipped = np.clip(np.rint(np.asarray(values, dtype=np.float64)), min_value, max_value)
    return format_label([float(v) for v in clipped], names)


def annotate_records(records: List[Dict], client, names: Optional[Sequence[str]] = None, batch_size: int = 32,
                     min_value: float = 0, max_value: float = 4, assistant: str = "Assistant",
                     chat_tokens: Optional[dict] = None, where: str = "input", max_length: Optional[int] = None) -> int:
    """Set ``label`` on every Assistant turn of ``records`` in place; returns the number labelled.
    ``client`` is a :class:`RemoteGPTRMClient` with a tokenizer; ``max_length`` keeps each text's
    last tokens, as reward-model training does."""
    if min_value > max_value:
        raise ConfigError(f"--min-value {min_value} is above --max-value {max_value}")
    jobs = []
    for record in records:
        require_fields(record, ["conversations"], where, types=(list,))
        for turn_no, turn in enumerate(record["conversations"]):
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise DataError(f"{where}:{record['__line__']}: conversations[{turn_no}] needs 'from' and 'value'")
        jobs += [(record, i, text) for i, text in assistant_turn_texts(record, chat_tokens, assistant)]
    futures = [client.infer_texts([text for _, _, text in jobs[s : s + batch_size]], max_length)
               for s in range(0, len(jobs), batch_size)]
    start = 0
    for future in futures:
        rewards = np.asarray(future.result())
        rewards = rewards.reshape(len(rewards), -1)
        if names is None:
            if rewards.shape[1] != len(NEMO_ATTRIBUTES):
                raise ConfigError(f"the server returns {rewards.shape[1]} attributes: pass --attributes with "
                                  f"{rewards.shape[1]} comma-separated names")
            names = NEMO_ATTRIBUTES
        if rewards.shape[1] != len(names):
            raise ConfigError(f"--attributes names {len(names)} attributes ({','.join(names)}) but the server "
                              f"returns {rewards.shape[1]}")
        for row, (record, turn_no, _) in zip(rewards, jobs[start : start + len(rewards)]):
            if not np.isfinite(row).all():
                raise DataError(f"{where}:{record['__line__']}: conversations[{turn_no}]: the server returned "
                                f"non-finite values {row.tolist()}")
            record["conversations"][turn_no]["label"] = values_to_label(row, names, min_value, max_value)
            record.setdefault("type", "VALUE_TO_TEXT")  # NeMo's chat format renders labels only with a type
        start += len(rewards)
    return len(jobs)


def main(argv=None) -> None:
    from nemo_aligner.servers.clients import RemoteGPTRMClient
    from nemo_aligner.utils.nemo_file import load_tokenizer, read_model_config
    from nemo_aligner.utils.tokenizers import ByteTokenizer

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
    client = RemoteGPTRMClient(args.host, args.port, tokenizer, args.model_name, timeout_s=args.timeout_s,
                               key="--host and --port", wait_s=args.wait_s)
    names = [n.strip() for n in args.attributes.split(",")] if args.attributes else None
    count = annotate_records(records, client, names, args.batch_size, args.min_value, args.max_value,
                             chat_tokens=chat_tokens, where=args.input_file,
                             max_length=int(seq_length) if seq_length else None)
    write_jsonl(args.output_file, ({k: v for k, v in r.items() if not k.startswith("__")} for r in records))
    print(f"labelled {count} assistant turns of {len(records)} conversations: {args.output_file}", flush=True)
