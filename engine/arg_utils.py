"""Command-line flags for every EngineConfig field, generated from the dataclass so that a new
knob appears in `engine serve`, `engine generate` and `engine bench` without further edits, with
the same name, units and help text in each (and in `engine plan`, through `add_engine_arg`).

Light on purpose (argparse + engine.config): `engine plan` imports it and must not load torch.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, fields

from engine.config import (ATTENTION_BACKENDS, DEVICES, DTYPES, GGUF_ACTIVATIONS, GGUF_WEIGHTS, KV_CACHE_DTYPES,
                           QUANTIZATION_GROUP_SIZES, QUANTIZATIONS, SIZE_UNITS, EngineConfig, canonical_dtype,
                           parse_size)

# vLLM's short spellings, and the names `engine plan` used before it shared this vocabulary.
ALIASES = {
    "tensor_parallel_size": ("-tp", "--tp"),
    "pipeline_parallel_size": ("-pp", "--pp"),
    "data_parallel_size": ("-dp", "--dp"),
}
# Engine fields that only mean something behind the HTTP server (skipped by `engine generate`).
SERVING_ONLY = ("max_waiting_requests", "max_logprobs", "log_requests")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_CHOICES = {"dtype": DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "device": DEVICES,
            "attention_backend": ATTENTION_BACKENDS, "gguf_weights": GGUF_WEIGHTS, "quantization": QUANTIZATIONS,
            "quantization_group_size": QUANTIZATION_GROUP_SIZES, "cpu_gguf_activations": GGUF_ACTIVATIONS}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default (unless its help already says it); keeps docstring layout."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or not action.option_strings or default is None or default is argparse.SUPPRESS:
            return text
        if default is False and not isinstance(action, argparse.BooleanOptionalAction):
            return text  # a plain switch: off unless given
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """allow_abbrev off: a copied flag that only starts like one of ours (`--kv-cache-memory` for
    `--kv-cache-memory-gib`) must be an "unrecognized argument", not a confusing error about the
    other flag. Subparsers inherit the class (argparse builds them with `type(parent)`). An error is
    one line naming the flag and what to do, without the usage block (`--help` has it)."""

    def __init__(self, *args, allow_abbrev: bool = False, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            message = unrecognized(message[len(prefix):].split(), self.prog)
        self.exit(2, f"{self.prog}: error: {message}\n")


# vLLM's flags that have no counterpart here, and what to do instead (a pasted vLLM command line).
VLLM_ONLY_FLAGS = {
    "--load-format": "weights load from the safetensors or .gguf files --model names",
    "--tokenizer-mode": "the model's Hugging Face tokenizer is used (--tokenizer for another one)",
    "--distributed-executor-backend": "ranks are processes the engine starts itself (or torchrun's): pass "
                                      "--tensor-parallel-size / --pipeline-parallel-size / --data-parallel-size",
    "--lora-modules": "adapters are named for clients by the server (`engine serve --enable-lora --lora-modules "
                      "NAME=PATH`); offline, pass LLM.generate(..., lora_request=LoRARequest(name, id, path))",
}


def unrecognized(flags: list[str], prog: str) -> str:
    """The message for flags the parser did not take: what to use instead for a vLLM flag, else
    where the flags are listed."""
    for flag in flags:
        hint = VLLM_ONLY_FLAGS.get(flag.split("=", 1)[0])
        if hint is not None:
            return f"{flag.split('=', 1)[0]} is a vLLM flag with no counterpart here: {hint}"
    return f"unrecognized arguments: {' '.join(flags)} (`{prog} --help` lists the flags)"


def parse_bytes(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_bytes(n: int) -> str:
    """2147483648 -> '2GiB': the largest binary unit that divides n (help text, logs)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        size = SIZE_UNITS[unit.lower()]
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _dtype(text: str) -> str:
    return canonical_dtype(text)  # argparse then checks the canonical name against the choices


def _optional(kind):
    """An int flag whose field may be None: `none` sets None (e.g. --max-waiting-requests none)."""
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


def _base_type(annotation) -> type:
    hints = {"int": int, "float": float, "str": str, "bool": bool}
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for name, t in hints.items():
        if re.search(rf"\b{name}\b", text):
            return t
    return str


def engine_flags(name: str) -> list[str]:
    """Every option string of one EngineConfig field: `--kv-cache-memory`, `--tensor-parallel-size`, `-tp`, ..."""
    return ["--" + name.replace("_", "-"), *ALIASES.get(name, ())]


def add_engine_arg(parser, name: str, aliases: tuple[str, ...] = (), **overrides) -> argparse.Action:
    """Add the flag of one EngineConfig field (name, aliases, type, help, default) to `parser` or an
    argument group. `aliases`: a command's own older spellings, kept working. `overrides` replace
    argparse keywords where a command means something narrower (e.g. `engine plan`'s validating
    types, or a default of None there)."""
    f = next(f for f in fields(EngineConfig) if f.name == name)
    default = f.default if f.default is not MISSING else None
    kind = _base_type(f.type)
    kwargs: dict = {"default": default, "help": f.metadata.get("help"), "dest": name}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif name == "kv_cache_memory":
        kwargs.update(type=_optional(parse_bytes), metavar="SIZE")
    elif name == "cuda_graph_sizes":
        kwargs.update(type=int, nargs="+", metavar="N")  # vLLM's form: --cuda-graph-sizes 1 2 4 8
    elif name in ("dtype", "kv_cache_dtype"):
        kwargs.update(type=_dtype, choices=_CHOICES[name])
    else:
        optional = "None" in str(f.type) and default is not None
        kwargs.update(type=_optional(kind) if optional else kind, choices=_CHOICES.get(name))
        if kind is int:
            kwargs["metavar"] = "N"
    kwargs.update(overrides)
    return parser.add_argument(*engine_flags(name), *aliases, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name not in skip:
            add_engine_arg(group, f.name)


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    """vLLM's `serve MODEL`: the model as a positional, the same as --model."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the same as --model (default: the embedded SmolLM2-135M-Instruct)")


def add_log_level(parser: argparse.ArgumentParser, top: bool = True) -> None:
    """`--log-level`, case-insensitive. Every (sub)parser takes it, so it may come before or after
    the subcommand; below the top its default is SUPPRESS, so it never overwrites the top's value."""
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                        default="INFO" if top else argparse.SUPPRESS,
                        help="debug, info, warning, error or critical (default: info)")


def walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) for `parser` and every subparser below it, e.g. (("bench", "latency"), p)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk_parsers(sub, (*path, name))


def engine_config_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields present on `args` (as parsed by add_engine_args)."""
    kwargs = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if kwargs.get("model") not in (None, tag):
            raise ValueError(f"the model is given twice ({tag!r} and --model {kwargs['model']!r}): give one")
        kwargs["model"] = tag
    return kwargs


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_config_kwargs(args))
