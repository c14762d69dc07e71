"""Command-line arguments shared by the Constitutional AI scripts (NeMo-Aligner's names and defaults)."""

import ast


def unescape(s):
    """``\\n`` typed on a command line as the newline it names (NeMo-Aligner's scripts do the same)."""
    return None if s is None else s.encode("utf-8").decode("unicode_escape")


def add_inference_args(parser, greedy, top_k, top_p, end_strings, port):
    group = parser.add_argument_group("inference", "inference (service) arguments")
    group.add_argument("--add_bos", type=str, choices=["True", "False"], default="False")
    group.add_argument("--top_k", type=int, default=top_k)
    group.add_argument("--top_p", type=float, default=top_p)
    group.add_argument("--all_probs", type=str, choices=["True", "False"], default="False")
    group.add_argument("--repetition_penalty", type=float, default=1.0)
    group.add_argument("--min_tokens_to_generate", type=int, default=1)
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--greedy", type=str, choices=["True", "False"], default=greedy)
    group.add_argument("--tokens_to_generate", type=int, default=1024)
    group.add_argument("--end_strings", type=str, nargs="*", default=end_strings)
    group.add_argument("--port", type=int, default=port, help="the text generation server's port")
    group.add_argument("--host", type=str, default="localhost", help="the text generation server's host")
    group.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one request")


# NeMo's <extra_id_*> chat template: the RL-CAI and HH preparation scripts' defaults, as in NeMo-Aligner.
EXTRA_ID_TEMPLATE = dict(user_format="<extra_id_1>User\n{MESSAGE}\n<extra_id_1>Assistant\n",
                         assistant_format="{MESSAGE}\n", system_format="<extra_id_0>System\n{MESSAGE}\n",
                         system_default_message="", eos_token="<extra_id_1>",
                         response_extract_pattern="<extra_id_1>Assistant\n")


def add_template_args(parser, **defaults):
    group = parser.add_argument_group("prompt_template", "prompt template")
    for name in ("user_format", "assistant_format", "system_format", "system_default_message", "bos_token",
                 "eos_token", "response_extract_pattern"):
        group.add_argument(f"--{name}", type=str, default=defaults.get(name))


def settings(args):
    """The server request fields of the parsed arguments."""
    if args.add_bos == "True" or args.all_probs == "True":
        raise SystemExit("error: --add_bos True and --all_probs True are not supported by the text generation server")
    return {"tokens_to_generate": args.tokens_to_generate, "min_tokens_to_generate": args.min_tokens_to_generate,
            "temperature": max(args.temperature, 1e-8), "top_k": args.top_k, "top_p": args.top_p,
            "greedy": args.greedy == "True", "repetition_penalty": args.repetition_penalty,
            "end_strings": [unescape(s) for s in args.end_strings or []]}


def template(args):
    from nemo_aligner.recipes.cai import ChatTemplate

    fields = {k: unescape(getattr(args, k)) for k in ("user_format", "assistant_format", "system_format",
                                                      "system_default_message", "bos_token", "eos_token",
                                                      "response_extract_pattern")}
    # An empty format or token: that part is absent. An empty system_default_message still writes the
    # system turn (its header with no text), as NeMo-Aligner's template does.
    return ChatTemplate(**{k: v for k, v in fields.items() if v or (k == "system_default_message" and v is not None)})


def literal(value, name):
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise SystemExit(f"error: --{name}={value!r} is not a Python literal") from None
