"""Byte tokenizers: NeMo's ``byte-level`` library and the built-in tokenizer (needs no files).

NeMo has shipped two ``ByteLevelTokenizer`` layouts under the one name ``byte-level``:

- NeMo 1.x: bytes 0-255, then ``pad`` 256, ``bos`` 257, ``eos`` 258 (259 ids);
- NeMo 2.x (2025 on): 512 ids, ``eos`` 0, ``pad`` 1, no ``bos``.

A ``.nemo`` does not say which NeMo wrote it, but the embedding does: fewer than 512 rows can
only be the 1.x layout. Both encode text as its UTF-8 bytes and nothing else (special-token
strings in the text stay bytes).

The built-in tokenizer is the 1.x layout plus NeMo's chat markers (``<extra_id_0..2>``, ids
259-261); its special tokens are recognised in text, so chat prompts stay short. It is written as ``library: byte-level``
with the markers listed under ``special_tokens_in_text`` (a key NeMo does not read): NeMo reads
the same ids for plain text and for pad/bos/eos. ``library: byte`` is this project's earlier
layout (``bos`` 256, ``eos`` 257, ``pad`` 258, the markers after them), still read.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Sequence

CHAT_MARKERS = ("<extra_id_0>", "<extra_id_1>", "<extra_id_2>")
# Ids 256 on, in this order: NeMo 1.x's byte-level specials, then the chat markers.
BYTE_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>") + CHAT_MARKERS
# The order of this project's earlier ``library: byte`` checkpoints.
LEGACY_BYTE_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>") + CHAT_MARKERS
NEMO2_BYTE_LEVEL_VOCAB = 512


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255), then named special tokens from id 256; those listed in
    ``in_text`` are also recognised inside text."""

    def __init__(self, special_tokens: Sequence[str] = BYTE_SPECIAL_TOKENS,
                 in_text: Optional[Iterable[str]] = None, library: str = "byte-level"):
        self.library = library
        self.special_tokens = list(special_tokens)
        self._special_ids: Dict[str, int] = {tok: 256 + i for i, tok in enumerate(self.special_tokens)}
        self._special_by_id = {i: tok for tok, i in self._special_ids.items()}
        self.in_text = list(self.special_tokens if in_text is None else in_text)
        unknown = [t for t in self.in_text if t not in self._special_ids]
        if unknown:
            raise ValueError(f"special tokens {unknown} have no id")
        self._pattern = (re.compile("(" + "|".join(re.escape(t) for t in self.in_text) + ")")
                         if self.in_text else None)

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
        if self._pattern is None:
            return list(text.encode("utf-8"))
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
            if 0 <= i < 256:
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
        cfg = {"library": self.library, "type": None, "model": None, "vocab_file": None, "merge_file": None}
        if self.library == "byte-level" and self.in_text:
            cfg["special_tokens_in_text"] = list(self.in_text)
        return cfg


class NeMo2ByteLevelTokenizer:
    """NeMo 2.x's ``ByteLevelTokenizer``: 512 ids, ``eos`` 0, ``pad`` 1, no ``bos``; text is its bytes."""

    library = "byte-level"

    def __init__(self, vocab_size: int = NEMO2_BYTE_LEVEL_VOCAB):
        self.vocab_size = vocab_size
        self.eos_id, self.pad_id, self.bos_id = 0, 1, None

    def text_to_ids(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def ids_to_text(self, ids: Iterable[int], skip_special: bool = True) -> str:
        keep = [int(i) for i in ids if 0 <= int(i) < 256 and not (skip_special and int(i) in (0, 1))]
        return bytes(keep).decode("utf-8", errors="replace")

    def config(self) -> dict:
        return {"library": "byte-level", "type": None, "model": None, "vocab_file": None, "merge_file": None}


def byte_level_tokenizer(cfg, padded_vocab_size: Optional[int] = None):
    """``library: byte-level``: the built-in tokenizer when the config lists ``special_tokens_in_text``,
    else NeMo's own layout, told apart by the checkpoint's vocabulary rows."""
    from nemo_aligner.utils.errors import ConfigError

    if cfg.get("special_tokens"):
        raise ConfigError(f"model.tokenizer.special_tokens={cfg.get('special_tokens')!r} is not supported with "
                          "library byte-level (NeMo gives such tokens ids that overlap the bytes)")
    in_text = cfg.get("special_tokens_in_text")
    if in_text:
        unknown = [t for t in in_text if t not in BYTE_SPECIAL_TOKENS]
        if unknown:
            raise ConfigError(f"model.tokenizer.special_tokens_in_text: {unknown} are not among the built-in "
                              f"special tokens {list(BYTE_SPECIAL_TOKENS)}")
        return ByteTokenizer(BYTE_SPECIAL_TOKENS, in_text=list(in_text))
    if padded_vocab_size is not None and int(padded_vocab_size) >= NEMO2_BYTE_LEVEL_VOCAB:
        return NeMo2ByteLevelTokenizer()
    return ByteTokenizer(BYTE_SPECIAL_TOKENS[:3], in_text=[])
