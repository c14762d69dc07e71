"""Built-in data: a deterministic, verifiable string task a tiny model learns in minutes on CPU.

Each prompt asks to reverse or sort a short word of letters, e.g. ``"reverse cabd ="``
with answer ``"dbac"``. The same generator writes every format the toolkit reads
(SFT, chat, reward-model comparisons, regression labels, DPO pairs, KTO, PPO prompts) and
``score`` is the rule-based reward: the fraction of answer characters that are right.

Command line::

    python -m nemo_aligner.data.nlp.builtin_task --out-dir data/builtin
"""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from nemo_aligner.data.nlp.jsonl import write_jsonl
from nemo_aligner.utils.errors import DataError

OPERATIONS = {
    "reverse": lambda word: word[::-1],
    "sort": lambda word: "".join(sorted(word)),
}
PROMPT_END = " ="


@dataclass
class BuiltinTask:
    """Generator and scorer of the built-in task."""

    seed: int = 0
    min_len: int = 3
    max_len: int = 6
    alphabet: str = "abcdefgh"
    operations: Tuple[str, ...] = ("reverse", "sort")

    def _rng(self, split: str) -> random.Random:
        return random.Random(f"{self.seed}:{split}")

    def example(self, rng: random.Random) -> Tuple[str, str]:
        """One ``(input, output)`` pair; the SFT template ``"{input} {output}"`` joins them."""
        op = rng.choice(self.operations)
        word = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
        return f"{op} {word}{PROMPT_END}", OPERATIONS[op](word)

    def examples(self, n: int, split: str = "train") -> List[Tuple[str, str]]:
        rng = self._rng(split)
        return [self.example(rng) for _ in range(n)]

    @staticmethod
    def prompt_text(task_input: str) -> str:
        """The prompt a policy is given (the SFT context, ending with the separator space)."""
        return f"{task_input} "

    @staticmethod
    def operands(prompt: str) -> Tuple[str, str]:
        """``(operation, word)`` of a prompt or task input (with or without the trailing space)."""
        parts = prompt.strip().removesuffix(PROMPT_END.strip()).split()
        if len(parts) < 2 or parts[0] not in OPERATIONS:  # a reward_fn run on another data set's prompts
            raise DataError(f"prompt {prompt[:80]!r} is not a built-in task prompt ('{'|'.join(OPERATIONS)} "
                            f"<word>{PROMPT_END} '): its reward scores only its own prompts")
        return parts[0], parts[1]

    @classmethod
    def target(cls, prompt: str) -> str:
        """The correct answer for a prompt (with or without the trailing space)."""
        op, word = cls.operands(prompt)
        return OPERATIONS[op](word)

    @staticmethod
    def answer(response: str) -> str:
        """The answer a response gives: its first word on its first line ("" when empty)."""
        return response.strip().split("\n")[0].split(" ")[0] if response.strip() else ""

    @classmethod
    def score(cls, prompt: str, response: str) -> float:
        """Reward in [0, 1]: matching characters over the longer of answer and response."""
        target = cls.target(prompt)
        answer = cls.answer(response)
        if not answer:
            return 0.0
        hits = sum(a == b for a, b in zip(answer, target))
        return hits / max(len(target), len(answer))

    def corrupt(self, answer: str, rng: random.Random, edits: Optional[int] = None) -> str:
        """A plausible wrong answer: one or two (at random) swapped, replaced, dropped or extra characters."""
        wrong = answer
        for _ in range(edits or rng.choice((1, 2))):
            wrong = self._edit(wrong, rng)
        return wrong if wrong != answer else self._edit(answer, rng)

    def rejected(self, task_input: str, answer: str, rng: random.Random) -> str:
        """A wrong answer for preference data: usually a near miss (one or two edits), sometimes the
        other operation's answer or a random word, so a reward model learns gross errors as well."""
        roll = rng.random()
        if roll < 0.6:
            return self.corrupt(answer, rng)
        if roll < 0.8:
            op, word = self.operands(task_input)
            other = [OPERATIONS[o](word) for o in OPERATIONS if o != op and OPERATIONS[o](word) != answer]
            if other:
                return other[0]
        wrong = "".join(rng.choice(self.alphabet) for _ in range(max(1, len(answer) + rng.randint(-1, 1))))
        return wrong if wrong != answer else self.corrupt(answer, rng)

    def _edit(self, answer: str, rng: random.Random) -> str:
        chars = list(answer)
        kind = rng.choice(["swap", "replace", "drop", "add"])
        if kind == "swap" and len(set(chars)) > 1:
            i, j = rng.sample(range(len(chars)), 2)
            while chars[i] == chars[j]:
                i, j = rng.sample(range(len(chars)), 2)
            chars[i], chars[j] = chars[j], chars[i]
        elif kind == "drop" and len(chars) > 1:
            chars.pop(rng.randrange(len(chars)))
        elif kind == "add":
            chars.insert(rng.randrange(len(chars) + 1), rng.choice(self.alphabet))
        else:
            i = rng.randrange(len(chars))
            chars[i] = rng.choice([c for c in self.alphabet if c != chars[i]])
        wrong = "".join(chars)
        return wrong if wrong != answer else wrong + rng.choice(self.alphabet)

    # ----------------------------------------------------------------- file formats
    def sft_records(self, n: int, split: str) -> List[Dict]:
        return [{"input": i, "output": o} for i, o in self.examples(n, split)]

    def rm_comparison_records(self, n: int, split: str) -> List[Dict]:
        """Chosen then rejected on consecutive lines, as NeMo-Aligner's RM data."""
        rng = self._rng(f"{split}:rm")
        out = []
        for i, o in self.examples(n, split):
            prompt = self.prompt_text(i)
            out.append({"text": prompt + o})
            out.append({"text": prompt + self.rejected(i, o, rng)})
        return out

    def regression_records(self, n: int, split: str) -> List[Dict]:
        """``{"text", "label"}`` with two SteerLM-style attributes (0-4): ``quality`` from the score and
        ``verbosity`` from the response length; one record in five leaves verbosity out (missing)."""
        rng = self._rng(f"{split}:reg")
        out = []
        for i, o in self.examples(n, split):
            prompt = self.prompt_text(i)
            response = o if rng.random() < 0.4 else self.rejected(i, o, rng)
            quality = round(4 * self.score(prompt, response))
            verbosity = min(max(len(response) - 3, 0), 4)
            label = f"quality:{quality}" if rng.random() < 0.2 else f"quality:{quality},verbosity:{verbosity}"
            out.append({"text": prompt + response, "label": label})
        return out

    def steerlm_records(self, n: int, split: str) -> List[Dict]:
        """NeMo chat format for SteerLM: half the Assistant turns are right (``quality:4``), half are
        wrong answers labelled with their score (``quality:0``-``3``)."""
        rng = self._rng(f"{split}:steerlm")
        out = []
        for i, o in self.examples(n, split):
            response = o if rng.random() < 0.5 else self.rejected(i, o, rng)
            quality = round(4 * self.score(self.prompt_text(i), response))
            out.append({"system": "", "mask": "User", "type": "VALUE_TO_TEXT",
                        "conversations": [{"from": "User", "value": i},
                                          {"from": "Assistant", "value": response, "label": f"quality:{quality}"}]})
        return out

    def dpo_records(self, n: int, split: str) -> List[Dict]:
        rng = self._rng(f"{split}:dpo")
        return [
            {"prompt": self.prompt_text(i), "chosen_response": o, "rejected_response": self.rejected(i, o, rng)}
            for i, o in self.examples(n, split)
        ]

    def kto_records(self, n: int, split: str) -> List[Dict]:
        rng = self._rng(f"{split}:kto")
        out = []
        for i, o in self.examples(n, split):
            good = rng.random() < 0.5
            out.append({"prompt": self.prompt_text(i), "response": o if good else self.rejected(i, o, rng),
                        "preference": "chosen" if good else "rejected"})
        return out

    def chat_records(self, n: int, split: str) -> List[Dict]:
        """NeMo chat format, one User/Assistant exchange, the Assistant turn labelled (SteerLM style)."""
        return [
            {"system": "", "mask": "User", "type": "VALUE_TO_TEXT",
             "conversations": [{"from": "User", "value": i},
                               {"from": "Assistant", "value": o, "label": "quality:4"}]}
            for i, o in self.examples(n, split)
        ]

    def prompt_records(self, n: int, split: str) -> List[Dict]:
        return [{"text": self.prompt_text(i)} for i, _ in self.examples(n, split)]

    def candidate_answers(self, task_input: str, answer: str, rng: random.Random, n: int = 10) -> List[str]:
        """Answers a policy might give, right and wrong: the right one, the word itself and each
        operation's answer, then ``n`` drawn from edits of the answer (one to three), permutations,
        strings of the word's letters or of the alphabet (length 1 to the answer's + 3), the answer
        with letters appended, its prefixes and one letter repeated."""
        word = self.operands(task_input)[1]
        out = [answer, word, *(OPERATIONS[o](word) for o in OPERATIONS)]
        for _ in range(n):
            kind = rng.randrange(7)
            if kind == 0:
                out.append(self.corrupt(answer, rng, rng.choice((1, 1, 2, 3))))
            elif kind == 1:
                out.append("".join(rng.sample(answer, len(answer))))
            elif kind in (2, 3):
                letters = word if kind == 2 else self.alphabet
                out.append("".join(rng.choice(letters) for _ in range(rng.randint(1, len(answer) + 3))))
            elif kind == 4:
                out.append(answer + "".join(rng.choice(word + self.alphabet) for _ in range(rng.randint(1, 3))))
            elif kind == 5:
                out.append(answer[: rng.randrange(1, len(answer))] if len(answer) > 1 else answer + answer)
            else:
                out.append(rng.choice(word) * rng.randint(max(1, len(answer) - 1), len(answer) + 2))
        return out

    def scored_records(self, n: int, split: str, answers_per_prompt: int = 4) -> List[Dict]:
        """Regression reward-model data (``model.reward_model_type=regression``): for ``n`` prompts,
        the right answer and ``answers_per_prompt`` distinct :meth:`candidate_answers`, each
        ``{"text", "label"}`` with the label ``4 * score`` (0-4, as SteerLM's quality)."""
        rng = self._rng(f"{split}:scored")
        out = []
        for task_input, answer in self.examples(n, split):
            prompt = self.prompt_text(task_input)
            others = sorted(set(self.candidate_answers(task_input, answer, rng)) - {answer})
            for text in [answer] + rng.sample(others, min(answers_per_prompt, len(others))):
                out.append({"text": prompt + text, "label": 4 * self.score(prompt, text)})
        return out

    @classmethod
    def _samples_by_prompt(cls, samples: List[Dict]) -> Dict[str, List[str]]:
        """``{prompt: [response, ...]}`` of ``{"prompt", "response"}`` records (as ``generate_gpt.py``
        writes them), each checked to be a built-in task prompt (DataError naming the record)."""
        by_prompt: Dict[str, List[str]] = {}
        for i, record in enumerate(samples):
            if not isinstance(record, dict):
                raise DataError(f"sample {i + 1}: a record with 'prompt' and 'response', not {type(record).__name__}")
            where = f"{record.get('__file__', 'samples')}:{record.get('__line__', i + 1)}"
            if not all(isinstance(record.get(k), str) for k in ("prompt", "response")):
                raise DataError(f"{where}: needs string fields 'prompt' and 'response'")
            try:
                cls.target(record["prompt"])
            except DataError as err:
                raise DataError(f"{where}: {err}") from None
            by_prompt.setdefault(record["prompt"], []).append(record["response"])
        return by_prompt

    @classmethod
    def labelled_comparison_records(cls, samples: List[Dict], max_pairs_per_prompt: int = 4,
                                    seed: int = 0) -> List[Dict]:
        """Reward-model comparisons from a policy's own responses, labelled by :meth:`score` (the
        task's annotator): ``samples`` are ``{"prompt", "response"}`` records (several per prompt, as
        ``generate_gpt.py`` writes them). Each prompt's distinct answers and the right answer are
        ranked by score; up to ``max_pairs_per_prompt`` pairs with different scores are kept, the
        better one first, in NeMo-Aligner's consecutive-lines layout. A reward model trained on these
        has seen the kinds of answer the policy gives, not only the hand-made near misses."""
        rng = random.Random(seed)
        out = []
        for prompt, responses in cls._samples_by_prompt(samples).items():
            answers = {cls.answer(r) for r in responses}
            truth = cls.target(prompt)
            ranked = [(1.0, truth)] + [(cls.score(prompt, a), a) for a in sorted(answers - {truth})]
            pairs = [(a, b) for sa, a in ranked for sb, b in ranked if sa > sb]
            rng.shuffle(pairs)
            for better, worse in pairs[:max_pairs_per_prompt]:
                out += [{"text": prompt + better}, {"text": prompt + worse}]
        return out

    @classmethod
    def labelled_score_records(cls, samples: List[Dict]) -> List[Dict]:
        """Regression reward-model data from a policy's own responses: each ``{"prompt", "response"}``
        record becomes ``{"text": prompt + response, "label": 4 * score}``, the response as the
        policy wrote it (what PPO's reward model will be given)."""
        return [{"text": prompt + response, "label": 4 * cls.score(prompt, response)}
                for prompt, responses in cls._samples_by_prompt(samples).items() for response in responses]

    def write_all(self, out_dir: str, n_train: int = 2000, n_val: int = 200) -> Dict[str, str]:
        """Write every format for ``train`` and ``val``; returns ``{name: path}``."""
        os.makedirs(out_dir, exist_ok=True)
        writers = {
            "sft": self.sft_records,
            "chat": self.chat_records,
            "rm": self.rm_comparison_records,
            "regression": self.regression_records,
            "dpo": self.dpo_records,
            "kto": self.kto_records,
            "steerlm": self.steerlm_records,
            "prompts": self.prompt_records,
        }
        paths = {}
        for name, make in writers.items():
            for split, n in (("train", n_train), ("val", n_val)):
                path = os.path.join(out_dir, f"{name}_{split}.jsonl")
                write_jsonl(path, make(n, split))
                paths[f"{name}_{split}"] = path
        return paths


def reward(prompt: str, response: str) -> float:
    """The built-in task's rule-based reward as a plain function (``reward_fn`` for REINFORCE/RLOO)."""
    return BuiltinTask.score(prompt, response)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="data/builtin")
    parser.add_argument("--train", type=int, default=2000, help="training examples per format")
    parser.add_argument("--val", type=int, default=200, help="validation examples per format")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = BuiltinTask(seed=args.seed).write_all(args.out_dir, args.train, args.val)
    for name, path in paths.items():
        print(f"{name:>18}: {path}")


if __name__ == "__main__":
    main()
