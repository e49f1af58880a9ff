"""Every `--help` of the `engine` command: each flag documented with its default, no abbreviations,
and one spelling (with the same units) for each setting across serve, generate, bench and plan."""

from __future__ import annotations

import dataclasses

import argparse

import pytest

from engine.arg_utils import ALIASES, engine_flags, walk_parsers
from engine.cli import build_parser
from engine.config import EngineConfig

# Spellings that once named an EngineConfig setting somewhere: where one still exists it must be
# an alias of that setting, never a second setting of its own.
SYNONYMS = {
    "--kv-cache-gib": "kv_cache_memory",
    "--kv-cache-memory-gib": "kv_cache_memory",
    "--kv-dtype": "kv_cache_dtype",
    **{alias: name for name, aliases in ALIASES.items() for alias in aliases},
}
FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    return {" ".join(("engine", *path)): p for path, p in walk_parsers(build_parser())}


PARSERS = all_parsers()
COMMANDS = ["engine serve", "engine generate", "engine bench throughput", "engine bench latency",
            "engine bench serve", "engine plan train", "engine plan serve", "engine plan search"]


def flags(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield action


def test_every_command_is_walked():
    assert set(COMMANDS) <= set(PARSERS)


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_no_abbreviations(command):
    assert PARSERS[command].allow_abbrev is False


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_has_help_with_its_default(command):
    parser = PARSERS[command]
    formatter = parser._get_formatter()
    parser.format_help()  # renders: no bad %-format in a help string
    problems = []
    for action in flags(parser):
        if action.help == argparse.SUPPRESS:
            continue  # an internal flag, hidden on purpose
        name = "/".join(action.option_strings)
        if not (action.help or "").strip():
            problems.append(f"{name}: no help text")
            continue
        shown = formatter._get_help_string(action)
        plain_switch = action.default is False and action.nargs == 0
        if action.default not in (None, argparse.SUPPRESS) and not plain_switch and "default" not in shown:
            problems.append(f"{name}: default {action.default!r} not shown")
    assert not problems, f"{command}: " + "; ".join(problems)


def test_one_spelling_per_setting_across_commands():
    """An engine flag means the same setting everywhere; an EngineConfig setting is
    accepted under all its names (--tensor-parallel-size, -tp, --tp) wherever it appears; an old
    synonym is at most an alias."""
    dest_of: dict[str, tuple[str, str]] = {}
    problems = []
    for command, parser in PARSERS.items():
        for action in flags(parser):
            for option in action.option_strings:
                seen = dest_of.setdefault(option, (action.dest, command))
                if seen[0] != action.dest and FIELDS & {seen[0], action.dest}:
                    problems.append(f"{option} is {action.dest!r} in {command} but {seen[0]!r} in {seen[1]}")
                named = option.lstrip("-").replace("-", "_")
                if named in FIELDS and action.dest != named:
                    problems.append(f"{command}: {option} sets {action.dest!r}, not the setting {named!r}")
                if option in SYNONYMS and action.dest != SYNONYMS[option]:
                    problems.append(f"{command}: {option} is a second name for {SYNONYMS[option]!r}: "
                                    f"use {engine_flags(SYNONYMS[option])[0]}")
        options_of: dict[str, set[str]] = {}
        for action in flags(parser):
            options_of.setdefault(action.dest, set()).update(action.option_strings)
        for dest in FIELDS & set(options_of):
            missing = set(engine_flags(dest)) - options_of[dest]
            if missing:
                problems.append(f"{command}: {dest} lacks {sorted(missing)}")
    assert not problems, "\n".join(problems)


def test_same_units_across_commands():
    """`--kv-cache-memory 2GiB` and `--dtype half` mean the same wherever they are accepted."""
    checks = {"--kv-cache-memory": ("2GiB", 2 << 30), "--dtype": ("half", "float16"),
              "--kv-cache-dtype": ("bf16", "bfloat16")}
    problems = []
    for command, parser in PARSERS.items():
        for action in flags(parser):
            for option, (text, value) in checks.items():
                if option in action.option_strings:
                    parsed = action.type(text) if action.type else text
                    if parsed != value:
                        problems.append(f"{command}: {option} {text} gives {parsed!r}, not {value!r}")
    assert not problems, "\n".join(problems)
