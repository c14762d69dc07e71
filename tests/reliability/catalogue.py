"""Writes docs/reliability_catalogue.md from the tests' own case tables: every bad-input case, the
message it must produce (the test's pattern, shown as text) and the test that checks it.

    python tests/reliability/catalogue.py          # print
    python tests/reliability/catalogue.py --write  # rewrite docs/reliability_catalogue.md

``tests/test_bad_input_catalogue.py::test_the_catalogue_doc_is_generated_from_the_tests`` fails
when the file differs from what this prints, so the doc's cases and counts follow the tests.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(os.path.dirname(TESTS), "docs", "reliability_catalogue.md")

# (section, test module, table, index of the message pattern in each case, test function)
TABLES = [
    ("jsonl data files", "test_bad_input_catalogue", "JSONL_CASES", 3, "test_bad_jsonl"),
    ("prompt templates", "test_bad_input_catalogue", "TEMPLATE_CASES", 1, "test_bad_prompt_template"),
    ("config values", "test_bad_input_catalogue", "CONFIG_CASES", 1, "test_bad_config"),
    ("`.nemo` model_config.yaml", "test_bad_input_catalogue", "MODEL_CONFIG_CASES", 1,
     "test_nemo_with_a_bad_model_config"),
    ("server host", "test_bad_input_catalogue", "HOST_CASES", 1, "test_a_server_host_that_is_not_this_machines_is_named"),
    ("checkpoint settings", "test_exp_manager", "CHECKPOINT_SETTING_CASES", 1,
     "test_checkpoint_settings_it_would_misread_are_refused"),
    ("server requests, refused by the request guard before tritonserver", "test_request_guard", "GUARD_CASES", 2,
     "test_bad_headers_are_refused_with_the_reason"),
    ("server requests, refused by the server's model code", "test_reward_server", "BAD_REQUESTS", 1,
     "test_bad_request_is_answered_and_the_server_keeps_serving"),
]


def as_text(pattern: str) -> str:
    """A message pattern as a reader sees the message: escapes dropped, wildcards as ``…``."""
    text = re.sub(r"\.\*\??|\.\+", "…", pattern)
    text = re.sub(r"\\d\+", "N", text)
    text = re.sub(r"\\(.)", r"\1", text)
    return text.replace("|", " / ").replace("`", "'")


def render() -> str:
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    sections, total = [], 0
    for title, module_name, table, index, test in TABLES:
        cases = getattr(importlib.import_module(module_name), table)
        total += len(cases)
        rows = [f"| `{case}` | `{as_text(entry[index])}` |" for case, entry in cases.items()]
        sections.append(f"## {title} ({len(cases)})\n\nChecked by `tests/{module_name}.py::{test}`.\n\n"
                        "| case | message |\n|---|---|\n" + "\n".join(rows) + "\n")
    head = ("# Bad-input catalogue\n\n"
            f"{total} cases, each refused with one message naming the file and line, the key, the tensor or the "
            "request's problem. Generated from the tests' case tables by `python tests/reliability/catalogue.py "
            "--write`; a test fails when this file and the tables differ. Whole-script behaviour (one `error:` "
            "line, exit status 1, no traceback) and the other cases are described in "
            "[reliability.md](reliability.md).\n\n")
    return head + "\n".join(sections)


if __name__ == "__main__":
    text = render()
    if "--write" in sys.argv[1:]:
        with open(DOC + ".tmp", "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(DOC + ".tmp", DOC)
    else:
        sys.stdout.write(text)
