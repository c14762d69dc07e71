"""NeMo's ``tiktoken`` tokenizer: a JSON vocabulary of byte sequences and ranks, encoded by the
``tiktoken`` library, with ``num_special_tokens`` ids reserved in front (NeMo's defaults: 1000
special ids, 131072 ids in all; ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 4).

The vocabulary file is a list of ``{"rank", "token_bytes" (base64), "token_str"}`` in rank order.
"""

from __future__ import annotations

import base64
import json
from typing import Dict, Iterable, List, Optional

# NeMo's split pattern (nemo/collections/common/tokenizers/tiktoken_tokenizer.py).
PATTERN_TIKTOKEN = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
DEFAULT_VOCAB_SIZE = 2**17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def load_mergeable_ranks(path: str, max_vocab: Optional[int] = None) -> Dict[bytes, int]:
    """The JSON vocabulary as tiktoken's ``{token bytes: rank}``, checked as NeMo checks it."""
    from nemo_aligner.utils.errors import CheckpointError

    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"model.tokenizer.vocab_file={path}: cannot read the tiktoken vocabulary ({err})") from err
    if not isinstance(vocab, list):
        raise CheckpointError(f"model.tokenizer.vocab_file={path}: a tiktoken vocabulary is a JSON list of "
                              "{rank, token_bytes, token_str}")
    if max_vocab is not None:
        vocab = vocab[:max_vocab]
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(vocab):
        if not isinstance(entry, dict) or entry.get("rank") != i or "token_bytes" not in entry:
            raise CheckpointError(f"model.tokenizer.vocab_file={path}: entry {i} is not "
                                  f"{{'rank': {i}, 'token_bytes': ..., 'token_str': ...}}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise CheckpointError(f"model.tokenizer.vocab_file={path}: entry {i} must be the single byte {i}")
        ranks[token] = i
    if len(ranks) != len(vocab):
        raise CheckpointError(f"model.tokenizer.vocab_file={path}: repeated token bytes")
    return ranks


class TiktokenTokenizer:
    library = "tiktoken"

    def __init__(self, vocab_file: str, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS, special_tokens: Optional[List[str]] = None,
                 pattern: str = PATTERN_TIKTOKEN):
        import tiktoken

        from nemo_aligner.utils.errors import ConfigError

        special = list(special_tokens or SPECIAL_TOKENS)
        if len(set(special)) != len(special) or not set(SPECIAL_TOKENS) <= set(special):
            raise ConfigError(f"model.tokenizer.special_tokens={special}: must be unique and include {SPECIAL_TOKENS}")
        if not len(special) <= num_special_tokens < vocab_size:
            raise ConfigError(f"model.tokenizer: {len(special)} special tokens <= num_special_tokens="
                              f"{num_special_tokens} < vocab_size={vocab_size} does not hold")
        self.vocab_file = vocab_file
        self.pattern = pattern
        self.num_special_tokens = num_special_tokens
        self._vocab_size_cfg = vocab_size
        ranks = load_mergeable_ranks(vocab_file, max_vocab=vocab_size - num_special_tokens)
        self.vocab_size = num_special_tokens + len(ranks)
        self.special_tokens = special + [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        self.special_tokens_cfg = special_tokens
        self.unk_id = special.index("<unk>")
        self.bos_id = special.index("<s>")
        self.eos_id = special.index("</s>")
        self.pad_id = special.index("<pad>")
        self.encoding = tiktoken.Encoding(name="nemo_tiktoken", pat_str=pattern, mergeable_ranks=ranks,
                                          special_tokens={})

    def token_to_id(self, token: str) -> int:
        if token in self.special_tokens:
            return self.special_tokens.index(token)
        return self.encoding.encode_single_token(token) + self.num_special_tokens

    def text_to_ids(self, text: str) -> List[int]:
        return [t + self.num_special_tokens for t in self.encoding.encode(text, allowed_special=set())]

    def ids_to_text(self, ids: Iterable[int], skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i >= self.num_special_tokens]
        out: List[str] = []
        run: List[int] = []
        for i in ids:
            if i >= self.num_special_tokens:
                run.append(i - self.num_special_tokens)
                continue
            if run:
                out.append(self.encoding.decode(run))
                run = []
            out.append(self.special_tokens[i])
        if run:
            out.append(self.encoding.decode(run))
        return "".join(out)

    def artifacts(self) -> Dict[str, str]:
        return {"vocab_file": self.vocab_file}

    def config(self) -> dict:
        cfg = {"library": "tiktoken", "type": "tiktoken", "model": None, "vocab_file": self.vocab_file,
               "merge_file": None, "delimiter": None, "sentencepiece_legacy": False}
        # NeMo reads neither key (it uses its defaults); written only where they differ from those.
        if self._vocab_size_cfg != DEFAULT_VOCAB_SIZE:
            cfg["vocab_size"] = self._vocab_size_cfg
        if self.num_special_tokens != DEFAULT_NUM_SPECIAL_TOKENS:
            cfg["num_special_tokens"] = self.num_special_tokens
        if self.special_tokens_cfg:
            cfg["special_tokens"] = list(self.special_tokens_cfg)
        return cfg
