"""Tokenizers: a built-in byte-level tokenizer (no files) and Hugging Face tokenizers from a local directory.

Both expose NeMo's tokenizer surface: ``text_to_ids``, ``ids_to_text``, ``bos_id``,
``eos_id``, ``pad_id``, ``vocab_size``.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Iterable, List, Optional

from nemo_aligner.utils.errors import ConfigError

# NeMo's chat template markers; single tokens here so prompts stay short.
BYTE_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<extra_id_0>", "<extra_id_1>", "<extra_id_2>")


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) plus NeMo's special tokens; needs no vocabulary file."""

    library = "byte"

    def __init__(self, special_tokens: Iterable[str] = BYTE_SPECIAL_TOKENS):
        self.special_tokens = list(special_tokens)
        self._special_ids: Dict[str, int] = {tok: 256 + i for i, tok in enumerate(self.special_tokens)}
        self._special_by_id = {i: tok for tok, i in self._special_ids.items()}
        self._pattern = re.compile("(" + "|".join(re.escape(t) for t in self.special_tokens) + ")")

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    @property
    def bos_id(self) -> int:
        return self._special_ids["<bos>"]

    @property
    def eos_id(self) -> int:
        return self._special_ids["<eos>"]

    @property
    def pad_id(self) -> int:
        return self._special_ids["<pad>"]

    def token_to_id(self, token: str) -> int:
        return self._special_ids[token]

    def text_to_ids(self, text: str) -> List[int]:
        ids: List[int] = []
        for piece in self._pattern.split(text):
            if not piece:
                continue
            if piece in self._special_ids:
                ids.append(self._special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def ids_to_text(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = bytearray()
        text: List[str] = []
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
                continue
            if out:
                text.append(out.decode("utf-8", errors="replace"))
                out = bytearray()
            if not skip_special and i in self._special_by_id:
                text.append(self._special_by_id[i])
        if out:
            text.append(out.decode("utf-8", errors="replace"))
        return "".join(text)

    def config(self) -> dict:
        return {"library": "byte", "type": None, "model": None}


# Files of a Hugging Face model directory that belong with its tokenizer (besides *token* files).
TOKENIZER_FILES = ("vocab.json", "merges.txt", "vocab.txt", "spiece.model", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never from the hub)."""

    library = "huggingface"

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise ConfigError(f"tokenizer directory {path!r} does not exist (model.tokenizer.type)")
        from transformers import AutoTokenizer

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.own_pad_id = self.tokenizer.pad_token_id  # before the fallback below: what an export declares
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def bos_id(self) -> Optional[int]:
        return self.tokenizer.bos_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def token_to_id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)

    def text_to_ids(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def ids_to_text(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def files(self) -> List[str]:
        """Files that make up this tokenizer (stored inside a ``.nemo``), with the chat template and
        the generation settings (EOS ids) that travel with it into an export."""
        names = []
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            if os.path.isfile(full) and ("token" in name or name in TOKENIZER_FILES):
                names.append(full)
        return names

    def config(self) -> dict:
        return {"library": "huggingface", "type": self.path, "model": None}


def build_tokenizer(tokenizer_cfg) -> "ByteTokenizer | HFTokenizer":
    """Tokenizer from ``model.tokenizer`` (``library: byte`` or ``library: huggingface`` with ``type: <dir>``)."""
    if tokenizer_cfg is None:
        return ByteTokenizer()
    library = str(tokenizer_cfg.get("library", "byte") or "byte").lower()
    if library == "byte":
        return ByteTokenizer()
    if library in ("huggingface", "hf"):
        path = tokenizer_cfg.get("type")
        if not path:
            raise ConfigError("model.tokenizer.type must be a local Hugging Face tokenizer directory")
        return HFTokenizer(str(path))
    raise ConfigError(f"model.tokenizer.library={library!r} is not supported (use 'byte' or 'huggingface')")
