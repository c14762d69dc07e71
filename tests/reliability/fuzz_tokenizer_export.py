"""Tokenizer export fuzzing: train a sentencepiece model with random trainer settings (BPE or unigram;
normalization rule nmt_nfkc, nfkc, nmt_nfkc_cf, nfkc_cf or identity; dummy prefix, extra-whitespace
removal, digit splitting, byte fallback, whitespace-only pieces, user-defined symbols, each on or off)
on a random corpus, wrap it as NeMo does (``sentencepiece_legacy`` on or off, NeMo's legacy special
tokens sometimes), and export it with ``write_hf_tokenizer``. The export must either refuse in one
line or write a tokenizer that ``AutoTokenizer`` loads and that encodes and decodes held-out random
texts (none of the export's own probe texts) exactly as the model's tokenizer does. A written
tokenizer that differs is a failure: the probes let a wrong conversion through.

    python tests/reliability/fuzz_tokenizer_export.py                 # 60 runs, seed 0
    python tests/reliability/fuzz_tokenizer_export.py --runs 200 --seed 3
    python tests/reliability/fuzz_tokenizer_export.py --tiktoken      # NeMo's tiktoken vocabularies

With ``--tiktoken`` each run trains a byte-level BPE vocabulary of random size with tiktoken's own
trainer on a random corpus and writes it as NeMo's tiktoken JSON (random ``num_special_tokens``).

Texts of a kind the export reported a difference on (special-token strings; a combining mark, where
it reported one after a character NFKC replaces) are not held against it.
Exit status 1 if any run failed (a wrong tokenizer written, or a traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import sys
import tempfile
import traceback
import unicodedata

ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"()[]{}<>|/\\+-*=_#@$%&~`^") + \
    [" ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "\r", "ü", "ï", "é", "ß", "Ä", "ñ", "中", "文", "日", "한",
     "🙂", "👍🏽", "ﬁ", "Ａ", "①", "\u00a0", "\u2003", "\u200b", "\u2581", "\u0301", "İ", "ǅ", "Ω", "ℌ", "²"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "nemo", "aligner",
         "reward", "policy", "User", "Assistant", "System", "def", "return", "12", "345", "3.14", "naïve", "café"]


def random_text(rng: random.Random, longest: int = 60) -> str:
    if rng.random() < 0.5:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, longest)))
    sep = [" ", " ", "  ", "\n", "\t", ", ", ""]
    return "".join(rng.choice(WORDS) + rng.choice(sep) for _ in range(rng.randint(1, 12)))


def settings(rng: random.Random) -> dict:
    kind = rng.choice(["bpe", "unigram"])
    s = dict(model_type=kind,
             normalization_rule_name=rng.choice(["nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity"]),
             add_dummy_prefix=rng.random() < 0.8, remove_extra_whitespaces=rng.random() < 0.5,
             split_digits=rng.random() < 0.5, byte_fallback=rng.random() < 0.5,
             allow_whitespace_only_pieces=rng.random() < 0.3, character_coverage=rng.choice([1.0, 0.9995, 0.98]))
    if rng.random() < 0.3:
        s["user_defined_symbols"] = rng.sample(["<extra_id_0>", "<|im_start|>", "[INST]", "@@", "\n\n"], 2)
    return s


def one_run(run: int, rng: random.Random, work: str) -> tuple:
    """(outcome, detail): refused, exact, WRONG or TRACEBACK."""
    import sentencepiece as spm

    from nemo_aligner.utils.tokenizers import build_tokenizer

    corpus = os.path.join(work, f"corpus{run}.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(random_text(rng, 120) for _ in range(400)))
    s = settings(rng)
    prefix = os.path.join(work, f"sp{run}")
    vocab = rng.choice([150, 300, 600]) + (256 if s["byte_fallback"] else 0)
    try:
        spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=vocab, bos_id=1, eos_id=2,
                                       unk_id=0, pad_id=-1, minloglevel=4, hard_vocab_limit=False, **s)
    except RuntimeError as err:  # settings sentencepiece itself rejects for this corpus
        return "skipped", f"{s}: {str(err).splitlines()[0][:80]}"
    cfg = {"library": "sentencepiece", "model": prefix + ".model", "sentencepiece_legacy": rng.random() < 0.5}
    if cfg["sentencepiece_legacy"] and rng.random() < 0.5:
        cfg["special_tokens"] = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
        cfg["additional_special_tokens"] = ["<extra_id_0>", "<extra_id_1>"]
    described = f"{s}, legacy={cfg['sentencepiece_legacy']}, specials={'special_tokens' in cfg}, vocab={vocab}"
    return export_and_compare(build_tokenizer(cfg), os.path.join(work, f"hf{run}"), rng, described,
                              ["<s>", "</s>", "<unk>", "<pad>", "<extra_id_0>", "<extra_id_1>"])


def one_tiktoken_run(run: int, rng: random.Random, work: str) -> tuple:
    import base64
    import json

    from tiktoken._educational import bpe_train

    from nemo_aligner.utils.tokenizers import build_tokenizer
    from nemo_aligner.utils.tokenizers.tiktoken_tokenizer import PATTERN_TIKTOKEN

    corpus = "\n".join(random_text(rng, 120) for _ in range(200))
    size = rng.choice([260, 300, 400])
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # the trainer draws its merges
        ranks = bpe_train(corpus, size, PATTERN_TIKTOKEN)
    path = os.path.join(work, f"vocab{run}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump([{"rank": r, "token_bytes": base64.b64encode(b).decode(), "token_str": b.decode("utf-8", "replace")}
                   for b, r in sorted(ranks.items(), key=lambda item: item[1])], f)
    specials = rng.choice([10, 100, 1000])
    tok = build_tokenizer({"library": "tiktoken", "vocab_file": path, "num_special_tokens": specials,
                           "vocab_size": specials + size})
    return export_and_compare(tok, os.path.join(work, f"hf{run}"), rng,
                              f"tiktoken vocabulary of {size}, {specials} special ids",
                              ["<s>", "</s>", "<unk>", "<SPECIAL_5>"])


def export_and_compare(tok, out: str, rng: random.Random, described: str, specials) -> tuple:
    """Export ``tok`` into ``out`` and compare the result with it on 300 held-out random texts (a fifth
    with one of ``specials`` inside); texts of a kind the export reported a difference on are skipped."""
    from nemo_aligner.utils.tokenizers.hf_export import (COMBINING_AFTER_COMPATIBILITY, SPECIAL_TOKEN_STRINGS,
                                                          NotExportable, write_hf_tokenizer)
    from nemo_aligner.utils.tokenizers.huggingface import auto_tokenizer

    os.makedirs(out)
    try:
        caveats = write_hf_tokenizer(tok, out, add_bos=rng.random() < 0.5)
    except NotExportable as why:
        if os.listdir(out):
            return "WRONG", f"{described}: refused but left {os.listdir(out)}"
        return "refused", f"{described}: {why}"
    hf = auto_tokenizer(out)
    reported = {c.split(" the converted tokenizer")[0][len("on text with "):] for c in caveats}
    for _ in range(300):
        text = random_text(rng)
        if rng.random() < 0.2:
            text = text[: len(text) // 2] + rng.choice(specials) + text[len(text) // 2:]
        if SPECIAL_TOKEN_STRINGS in reported and any(t in text for t in specials):
            continue
        if COMBINING_AFTER_COMPATIBILITY in reported and any(unicodedata.combining(c) for c in text):
            continue
        ours, theirs = tok.text_to_ids(text), hf.encode(text, add_special_tokens=False)
        if ours != theirs:
            return "WRONG", f"{described}: {text!r} model {ours[:12]} transformers {theirs[:12]}"
        # an unknown piece decodes as each library's own mark (sentencepiece " ⁇ ")
        if hf.unk_token_id not in ours and tok.ids_to_text(ours) != hf.decode(ours, skip_special_tokens=True):
            return "WRONG", f"{described}: decoding {text!r}: {tok.ids_to_text(ours)!r} vs {hf.decode(ours)!r}"
    return ("exact, with a reported difference" if caveats else "exact"), described


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiktoken", action="store_true", help="NeMo tiktoken vocabularies instead of sentencepiece")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (kept anyway after a failure)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="fuzz_tokenizer_export_")
    counts, failures = {}, []
    try:
        for run in range(args.runs):
            try:
                result, detail = (one_tiktoken_run if args.tiktoken else one_run)(run, rng, work)
            except Exception:
                result, detail = "TRACEBACK", traceback.format_exc(limit=4)
            counts[result] = counts.get(result, 0) + 1
            if result in ("WRONG", "TRACEBACK"):
                failures.append((run, result, detail))
                print(f"run {run}: {result}: {detail}", flush=True)
    finally:
        if failures or args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"seed {args.seed}, {args.runs} runs: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
