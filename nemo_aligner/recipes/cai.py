"""Constitutional AI data (NeMo-Aligner's ``examples/nlp/cai`` scripts) from a served model.

- Supervised stage (``generate_sl_cai_dataset.py``): each red-teaming prompt is answered, the answer
  critiqued against a randomly drawn principle, then revised; the revisions become chat SFT records
  (blended with a helpfulness SFT set when one is given) for ``train_gpt_sft.py model.data.chat=True``.
- RL stage (``generate_rl_cai_dataset.py``): several responses per prompt (one per temperature), the
  most and least harmless picked by a judge under the constitution; written as reward-model comparisons,
  PPO prompts and DPO pairs per split, optionally blended with human helpfulness preferences.

The policy is a text generation server with NeMo's REST protocol (``generate_gpt.py server=True``).
The judge is an OpenAI-compatible chat endpoint (NeMo-Aligner's ``--ngc-api-key``/``--ngc-url``) or,
without a key, the served model itself, reading the choice from the log-probabilities it gives each
response number after the question (as the CAI paper does), so any model yields a decision.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from nemo_aligner.data.nlp.jsonl import read_jsonl, write_jsonl
from nemo_aligner.servers.clients import TextGenerationClient
from nemo_aligner.utils.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

TEMPERATURES = (0.01, 0.51, 1.01, 1.51)  # NeMo-Aligner's np.arange(0.01, 2.01, 0.5)


@dataclass
class ChatTemplate:
    """NeMo-Aligner's ``UserAssistantPromptTemplate`` settings: each role's format holds ``{MESSAGE}``; the
    user format ends with the assistant's header, so a prompt ending with a user turn asks for a reply."""
    user_format: str = "{MESSAGE}"
    assistant_format: str = "{MESSAGE}\n"
    system_format: Optional[str] = None
    system_default_message: Optional[str] = None
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    response_extract_pattern: Optional[str] = None

    def __post_init__(self):
        for name in ("user_format", "assistant_format", "system_format"):
            value = getattr(self, name)
            if value is not None and "{MESSAGE}" not in value:
                raise ConfigError(f"--{name}={value!r} must contain {{MESSAGE}}")

    def format(self, messages: Sequence[Dict], system: Optional[str] = None) -> str:
        text = self.bos_token or ""
        system = self.system_default_message if system is None else system
        if self.system_format and system is not None:
            text += self.system_format.replace("{MESSAGE}", system)
        for m in messages:
            role = str(m["role"]).lower()
            fmt = self.user_format if role == "user" else self.assistant_format
            text += fmt.replace("{MESSAGE}", str(m["content"]))
        return text

    def extract_response(self, full: str, prompt: str, end_strings: Sequence[str] = ()) -> str:
        """The generated reply in a server's ``prompt + reply`` sentence, cut at the end-of-turn text."""
        if full.startswith(prompt):
            reply = full[len(prompt):]
        elif self.response_extract_pattern and self.response_extract_pattern in full:
            reply = full.split(self.response_extract_pattern)[-1]
        else:
            reply = full
        for end in [self.eos_token, *end_strings]:
            if end and end in reply:
                reply = reply[: reply.index(end)]
        return reply.strip()


# ----------------------------------------------------------------- inputs
def read_red_team_prompts(path: str) -> List[str]:
    """The first human turn of each record: Anthropic's red-teaming ``transcript`` ("Human: ... Assistant:"),
    or a ``prompt``/``text`` field."""
    prompts = []
    for record in read_jsonl(path):
        where = f"{path}:{record['__line__']}"
        text = record.get("transcript")
        if isinstance(text, str):
            start, end = text.find("Human:"), text.find("Assistant:")
            if start < 0 or end <= start:
                raise DataError(f"{where}: transcript has no 'Human: ... Assistant:' turn")
            prompts.append(text[start + len("Human:") : end].strip())
            continue
        field = next((k for k in ("prompt", "text") if isinstance(record.get(k), str)), None)
        if field is None:
            raise DataError(f"{where}: needs a 'transcript' (Anthropic's red-teaming format), 'prompt' or 'text' field")
        prompts.append(record[field].strip())
    if not prompts:
        raise DataError(f"{path}: no prompts")
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None:
        raise DataError(f"{path}: prompt {empty + 1} is empty")
    return prompts


def read_instructions(path: str) -> List[Tuple[str, str]]:
    """NeMo-Aligner's ``CritiqueRevisionInstructions.json``: ``{"harmful0": {"prompt": [critique request],
    "edit_request": revision request}, ...}`` as ``(critique, revision)`` requests."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not a JSON file of critique/revision instructions ({err})") from None
    out = []
    for key, inst in (data.items() if isinstance(data, dict) else []):
        if not (isinstance(inst, dict) and isinstance(inst.get("prompt"), list) and len(inst["prompt"]) == 1
                and isinstance(inst.get("edit_request"), str)):
            raise DataError(f"{path}: {key} must be {{\"prompt\": [critique request], \"edit_request\": revision request}}")
        critique = inst["prompt"][0].removesuffix("\n\nCritique:").removeprefix("\n\nCritiqueRequest: ").strip()
        revision = inst["edit_request"].removesuffix("\n\nRevision:").removeprefix("\n\nRevisionRequest: ").strip()
        out.append((critique, revision))
    if not out:
        raise DataError(f"{path}: holds no instructions")
    return out


def read_few_shot(path: Optional[str]) -> List[Dict]:
    """NeMo-Aligner's ``few_shot_samples_example.json``: ``{"samples": [[{"role", "content"}, ...], ...]}``,
    flattened into one conversation that precedes every prompt."""
    if not path:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            samples = json.load(f)["samples"]
        turns = [turn for sample in samples for turn in sample]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: not a few-shot samples file ({{\"samples\": [[turns]]}}): {err}") from None
    for turn in turns:
        if not (isinstance(turn, dict) and str(turn.get("role", "")).lower() in ("user", "assistant")
                and isinstance(turn.get("content"), str)):
            raise DataError(f"{path}: each turn needs a role (User/Assistant) and a content string, got {turn!r}")
    return turns


# ----------------------------------------------------------------- supervised stage
def _ask(client, template: ChatTemplate, conversations: List[List[Dict]], settings: dict) -> List[str]:
    prompts = [template.format(c) for c in conversations]
    sentences = client.generate(prompts, **settings)
    return [template.extract_response(s, p, settings.get("end_strings", ())) for s, p in zip(sentences, prompts)]


def sl_cai_record(prompt: str, revision: str, system: str = "") -> Dict:
    """A chat SFT record (NeMo-Aligner's SL-CAI output)."""
    return {"system": system, "conversations": [{"from": "User", "value": prompt, "label": None},
                                                {"from": "Assistant", "value": revision, "label": None}],
            "mask": "User", "dataset": "sl_cai_samples"}


def generate_sl_cai(client: TextGenerationClient, prompts: Sequence[str], instructions: Sequence[Tuple[str, str]],
                    few_shot: Sequence[Dict], template: ChatTemplate, settings: dict, batch_size: int,
                    seed: int) -> List[Dict]:
    """Initial response, critique and revision of each prompt; returns the raw samples (all six texts)."""
    rng = random.Random(seed)
    samples = []
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        drawn = [instructions[rng.randrange(len(instructions))] for _ in batch]
        chats = [list(few_shot) + [{"role": "User", "content": p}] for p in batch]
        initial = _ask(client, template, chats, settings)
        chats = [c + [{"role": "Assistant", "content": r}, {"role": "User", "content": d[0]}]
                 for c, r, d in zip(chats, initial, drawn)]
        critiques = _ask(client, template, chats, settings)
        chats = [c + [{"role": "Assistant", "content": r}, {"role": "User", "content": d[1]}]
                 for c, r, d in zip(chats, critiques, drawn)]
        revisions = _ask(client, template, chats, settings)
        for p, d, i, c, r in zip(batch, drawn, initial, critiques, revisions):
            samples.append({"initial_prompt": p, "initial_response": i, "critique_prompt": d[0],
                            "critique_response": c, "revision_prompt": d[1], "revision_response": r})
        logger.info("SL-CAI: %d of %d prompts", len(samples), len(prompts))
    return samples


def write_sl_cai(samples: Sequence[Dict], output: str, helpfulness: Optional[str], seed: int,
                 system: str = "") -> Dict:
    """The SFT file (revisions, blended with ``helpfulness`` chat records when given) and the raw
    samples beside it (``cai_output/``); refuses to overwrite ``output``."""
    if os.path.exists(output):
        raise ConfigError(f"--output-filepath={output} already exists; choose a new file")
    records = [sl_cai_record(s["initial_prompt"], s["revision_response"], system) for s in samples
               if s["revision_response"]]
    blended = list(records)
    if helpfulness:
        extra = read_jsonl(helpfulness)
        for r in extra:
            if not isinstance(r.get("conversations"), list):
                raise DataError(f"{helpfulness}:{r['__line__']}: not a chat SFT record (no 'conversations' list)")
        blended += [{k: v for k, v in r.items() if not k.startswith("__")} for r in extra]
        random.Random(seed).shuffle(blended)
    log_dir = os.path.join(os.path.dirname(os.path.abspath(output)), "cai_output")
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "cai_critique_revision_samples.json"), "w", encoding="utf-8") as f:
        json.dump(list(samples), f, indent=2)
    write_jsonl(os.path.join(log_dir, "cai_samples.jsonl"), records)
    write_jsonl(output, blended)
    return {"output": output, "revisions": len(records), "records": len(blended),
            "dropped_empty_revisions": len(samples) - len(records)}


# ----------------------------------------------------------------- RL stage
def judge_listing(prompt: str, responses: Sequence[str]) -> str:
    text = f"FULL TEXT: {prompt}"
    for i, response in enumerate(responses):
        text += f"\n #{i + 1}: \n {response}\n"
    return text


def judge_by_logprobs(client: TextGenerationClient, template: ChatTemplate, constitution: str, prompt: str,
                      responses: Sequence[str]) -> Optional[Tuple[int, int]]:
    """``(chosen, rejected)`` response indices from the model's log-probability of each response number
    after the question; None when every number scores the same."""
    listing = "".join(f"#{i + 1}: {r}\n" for i, r in enumerate(responses))
    question = template.format([{"role": "User", "content": f"{prompt}\n{listing}Which response is the most harmless?"}],
                               system=constitution) + "The most harmless response is #"
    scores = [row[-1] for row in client.logprobs([question + str(i + 1) for i in range(len(responses))])]
    chosen, rejected = max(range(len(scores)), key=scores.__getitem__), min(range(len(scores)), key=scores.__getitem__)
    return None if scores[chosen] == scores[rejected] else (chosen, rejected)


def judge_by_chat(api_key: str, url: str, model: str, constitution: str, prompt: str, responses: Sequence[str],
                  seed: int, timeout_s: float = 300.0) -> Optional[Tuple[int, int]]:
    """NeMo-Aligner's judge: an OpenAI-compatible chat endpoint answers ``{"chosen": x, "rejected": y}``."""
    import urllib.error
    import urllib.request

    payload = {"model": model, "stream": False, "temperature": 1e-7, "top_p": 1e-7, "max_tokens": 1024, "seed": seed,
               "messages": [{"role": "system", "content": constitution},
                            {"role": "user", "content": judge_listing(prompt, responses) +
                             "\nNow, choose the pair of responses as instructed:"}]}
    req = urllib.request.Request(url, data=json.dumps(payload).encode("utf-8"), method="POST",
                                 headers={"Authorization": f"Bearer {api_key}", "Accept": "application/json",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = json.loads(resp.read().decode("utf-8"))["choices"][0]["message"]["content"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as err:
        logger.warning("judge %s: no decision (%s)", url, err)
        return None
    return parse_judge_answer(text, len(responses))


def parse_judge_answer(text: str, n: int) -> Optional[Tuple[int, int]]:
    """``{"chosen": x, "rejected": y}`` (1-based) anywhere in ``text`` as 0-based indices; None if absent."""
    chosen = re.search(r"[\"']?chosen[\"']?\s*:\s*#?(\d+)", text)
    rejected = re.search(r"[\"']?rejected[\"']?\s*:\s*#?(\d+)", text)
    if not chosen or not rejected:
        return None
    c, r = int(chosen.group(1)) - 1, int(rejected.group(1)) - 1
    if not (0 <= c < n and 0 <= r < n) or c == r:
        return None
    return c, r


def generate_rl_candidates(client: TextGenerationClient, prompts: Sequence[str], template: ChatTemplate,
                           settings: dict, batch_size: int, temperatures: Sequence[float] = TEMPERATURES) -> List[Dict]:
    """One response per temperature for each prompt: ``{"prompt", "responses": [...]}``."""
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        per_temperature = [_ask(client, template, [[{"role": "User", "content": p}] for p in batch],
                                dict(settings, temperature=float(t), greedy=False)) for t in temperatures]
        out += [{"prompt": p, "responses": [r[i] for r in per_temperature]} for i, p in enumerate(batch)]
        logger.info("RL-CAI candidates: %d of %d prompts", len(out), len(prompts))
    return out


def preference_records(candidates: Sequence[Dict], choose) -> List[Dict]:
    """``{"prompt", "chosen", "rejected"}`` for each candidate set the judge (``choose(prompt, responses)``)
    decides; identical chosen and rejected texts are dropped (nothing to learn)."""
    out = []
    for c in candidates:
        decision = choose(c["prompt"], c["responses"])
        if decision is None:
            continue
        chosen, rejected = c["responses"][decision[0]], c["responses"][decision[1]]
        if chosen != rejected:
            out.append({"prompt": c["prompt"], "chosen": chosen, "rejected": rejected})
    return out


def split_records(records: Sequence[Dict], splits: Dict[str, float], shuffle: bool, seed: int) -> Dict[str, List[Dict]]:
    if not splits or any(not isinstance(v, (int, float)) or v < 0 for v in splits.values()) or sum(splits.values()) <= 0:
        raise ConfigError(f"--splits={splits} must map split names to non-negative fractions")
    order = list(records)
    if shuffle:
        random.Random(seed).shuffle(order)
    total, out, start = sum(splits.values()), {}, 0
    names = list(splits)
    for k, name in enumerate(names):
        end = len(order) if k == len(names) - 1 else start + round(len(order) * splits[name] / total)
        out[name] = order[start:end]
        start = end
    return out


def chat_prompt_path(output_dir: str, prefix: Optional[str], split: str, kind: str, suffix: str = "") -> str:
    """NeMo-Aligner's file names for chat-template data: ``<prefix>_<split>_<kind>_with_chat_prompt<suffix>.jsonl``."""
    return os.path.join(output_dir, f"{prefix + '_' if prefix else ''}{split}_{kind}_with_chat_prompt{suffix}.jsonl")


def write_rl_cai(records_by_split: Dict[str, List[Dict]], template: ChatTemplate, output_dir: str, prefix: str,
                 blend_with: Optional[Dict] = None, seed: int = 1234) -> Dict[str, Dict[str, str]]:
    """Per split: ``<prefix>_<split>_prompts_with_chat_prompt.jsonl`` (PPO prompts, ``{"text"}``),
    ``<prefix>_<split>_comparisons_with_chat_prompt.jsonl`` (reward-model pairs: chosen then rejected
    ``{"text"}`` lines) and ``<prefix>_<split>_dpo_with_chat_prompt.jsonl`` (DPO pairs). With
    ``blend_with`` (NeMo-Aligner's ``{"name", <split>: {"prompts": [...], "comparisons": [...]}}``) the
    prompts and comparisons are shuffled together with those files (pairs kept together)."""
    os.makedirs(output_dir, exist_ok=True)
    written: Dict[str, Dict[str, str]] = {}
    rng = random.Random(seed)
    eos = template.eos_token or ""
    for split, records in records_by_split.items():
        paths = {k: chat_prompt_path(output_dir, prefix, split, k) for k in ("prompts", "comparisons", "dpo")}
        existing = next((p for p in paths.values() if os.path.exists(p)), None)
        if existing:
            raise ConfigError(f"{existing} already exists; choose another --output-dir or --output-filename-prefix")
        prompts = [{"text": template.format([{"role": "User", "content": r["prompt"]}])} for r in records]
        pairs = [[{"text": template.format([{"role": "User", "content": r["prompt"]},
                                            {"role": "Assistant", "content": r[side]}]).rstrip("\n") + eos}
                  for side in ("chosen", "rejected")] for r in records]
        dpo = [{"prompt": p["text"], "chosen_response": r["chosen"] + eos, "rejected_response": r["rejected"] + eos}
               for p, r in zip(prompts, records)]
        blend = (blend_with or {}).get(split) or {}
        for path in blend.get("prompts", []) or []:
            prompts += [{k: v for k, v in r.items() if not k.startswith("__")} for r in read_jsonl(path)]
        for path in blend.get("comparisons", []) or []:
            lines = [{k: v for k, v in r.items() if not k.startswith("__")} for r in read_jsonl(path)]
            if len(lines) % 2:
                raise DataError(f"{path}: {len(lines)} lines; comparisons come in chosen/rejected pairs")
            pairs += [lines[i : i + 2] for i in range(0, len(lines), 2)]
        if blend:
            rng.shuffle(prompts)
            rng.shuffle(pairs)
        write_jsonl(paths["prompts"], prompts)
        write_jsonl(paths["comparisons"], [line for pair in pairs for line in pair])
        write_jsonl(paths["dpo"], dpo)
        written[split] = paths
    return written
