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
    ("architecture values", "test_bad_input_catalogue", "ARCHITECTURE_CASES", 1,
     "test_architecture_values_that_cannot_build_a_model_are_refused"),
    ("server host", "test_bad_input_catalogue", "HOST_CASES", 1, "test_a_server_host_that_is_not_this_machines_is_named"),
    ("checkpoint settings", "test_exp_manager", "CHECKPOINT_SETTING_CASES", 1,
     "test_checkpoint_settings_it_would_misread_are_refused"),
    ("server requests, refused by the request guard before tritonserver", "test_request_guard", "GUARD_CASES", 2,
     "test_bad_headers_are_refused_with_the_reason"),
    ("crafted HTTP requests to a running server", "test_reward_server", "CRAFTED_REQUESTS", 4,
     "test_crafted_http_requests_are_refused_before_triton_sees_them"),
    ("server requests, refused by the server's model code", "test_reward_server", "BAD_REQUESTS", 1,
     "test_bad_request_is_answered_and_the_server_keeps_serving"),
    ("knowledge-distillation records", "test_knowledge_distillation", "BAD_RECORDS", 1,
     "test_bad_records_name_file_and_line"),
]


# Cases with a test of their own: (section, test module, test function). The messages shown are the
# patterns the test itself checks (``match=...``, or a literal looked for in the script's stderr).
SINGLE_TESTS = [
    ("checkpoints", "test_bad_input_catalogue", "test_nemo_without_model_config"),
    ("checkpoints", "test_bad_input_catalogue", "test_nemo_that_is_not_a_tar"),
    ("checkpoints", "test_bad_input_catalogue", "test_nemo_from_a_different_architecture"),
    ("checkpoints", "test_bad_input", "test_missing_restore_path"),
    ("checkpoints", "test_bad_input", "test_truncated_nemo"),
    ("checkpoints", "test_bad_input", "test_resume_with_changed_architecture_keeps_checkpoint"),
    ("architecture and parallel sizes", "test_bad_input", "test_world_size_mismatch"),
    ("architecture and parallel sizes", "test_bad_input", "test_tp_does_not_divide_heads"),
    ("architecture and parallel sizes", "test_bad_input", "test_batch_sizes_checked"),
    ("architecture and parallel sizes", "test_bad_input", "test_sequence_parallel_on_cpu"),
    ("config keys and data paths", "test_bad_input", "test_missing_path"),
    ("config keys and data paths", "test_bad_input", "test_unknown_config_key"),
    ("config keys and data paths", "test_bad_input", "test_a_required_key_left_unset_is_named"),
    ("log directory", "test_exp_manager", "test_a_log_dir_in_use_by_a_live_run_is_refused"),
    ("log directory", "test_exp_manager", "test_a_log_dir_that_is_a_file_is_refused"),
    ("server requests", "test_reward_server", "test_port_in_use_is_named"),
]
_MATCH = re.compile(r"""(?:match=|check\(workdir, \w+, )(?:r|rf|f)?(["'])(.+?)\1""")
# a literal (or two joined by a line continuation) looked for in the script's output
_STDERR = re.compile(r"""(?:assert|and) (?:r|rf|f)?(["'])(.+?)\1\s*(?:\\\s*\n\s*(?:f)?["'](.+?)["']\s*)?"""
                     r"""in (?:proc\.)?(?:stderr|stdout)""")


def messages_checked_by(function) -> list:
    """The message patterns a test function's source checks."""
    import inspect

    source = inspect.getsource(function)
    found = [m.group(2) for m in _MATCH.finditer(source)]
    found += [m.group(2) + (m.group(3) or "") for m in _STDERR.finditer(source)]
    return list(dict.fromkeys(found))


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
    single: dict = {}
    for section, module_name, test in SINGLE_TESTS:
        function = getattr(importlib.import_module(module_name), test)
        messages = messages_checked_by(function)
        if not messages:
            raise SystemExit(f"tests/{module_name}.py::{test} checks no message this script can read")
        single.setdefault(section, []).append((module_name, test, messages))
    for section, entries in single.items():
        total += len(entries)
        rows = [f"| `tests/{m}.py::{t}` | " + "<br>".join(f"`{as_text(x)}`" for x in msgs) + " |" for m, t, msgs in entries]
        sections.append(f"## {section}: one test each ({len(entries)})\n\n| test | message |\n|---|---|\n"
                        + "\n".join(rows) + "\n")
    head = ("# Bad-input catalogue\n\n"
            f"{total} cases, each refused with one message naming the file and line, the key, the tensor or the "
            "request's problem. Generated from the tests' case tables, and from the patterns that single tests "
            "check, by `python tests/reliability/catalogue.py --write`; a test fails when this file and the "
            "tests differ. Whole-script behaviour (one `error:` "
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
