"""The documents in docs/ keep up with the code: every config key, every command-line option.

A key or option added without a line in docs/ fails here, naming it; so does a
documented one the code no longer has, and a documented default the code
does not use. Nothing in the repository points outside it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from agent_side.cli import build_parser
from target_side.config import RoleConfig, Settings
from target_side.tools import cli as target_cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# --- configuration.md -----------------------------------------------------------------------


def config_sections() -> dict[str, type[BaseModel]]:
    """Each TOML table of the config, by the heading configuration.md gives it."""
    found: dict[str, type[BaseModel]] = {}

    def walk(model: type[BaseModel], table: str) -> None:
        found[table] = model
        for name, field in model.model_fields.items():
            inner = _model_of(field.annotation)
            if inner is not None:
                walk(inner, f"{table}.{name}" if table else name)

    for name, field in Settings.model_fields.items():
        inner = _model_of(field.annotation)
        if inner is not None:
            walk(inner, name)
    walk(RoleConfig, "roles.NAME")  # the dict's values: [roles.NAME], [roles.NAME.limits]
    return found


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def keys_of(model: type[BaseModel]) -> dict[str, Any]:
    """The TOML keys a table takes (sub-tables are sections of their own), with defaults."""
    return {
        name: field.get_default(call_default_factory=True)
        for name, field in model.model_fields.items()
        if not field.exclude and _model_of(field.annotation) is None
    }


ROW = re.compile(r"\| `([a-z0-9_]+)` \|([^|]*)\|([^|]*)\|")


def documented_tables() -> dict[str, dict[str, str]]:
    """configuration.md's tables: ``## `[table]` `` headings, then ``| `key` | type | default``."""
    tables: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in (DOCS / "configuration.md").read_text().splitlines():
        heading = re.fullmatch(r"## `\[([^\]]+)\]`", line)
        if heading:
            current = tables.setdefault(heading.group(1), {})
        elif line.startswith("## "):
            current = None
        elif current is not None and (row := ROW.match(line)):
            current[row.group(1)] = row.group(3).strip()
    return tables


def test_configuration_md_documents_every_table() -> None:
    assert set(documented_tables()) == set(config_sections())


@pytest.mark.parametrize("table", sorted(config_sections()))
def test_configuration_md_documents_every_key_of(table: str) -> None:
    keys = keys_of(config_sections()[table])
    documented = documented_tables().get(table, {})
    missing = sorted(set(keys) - set(documented))
    gone = sorted(set(documented) - set(keys))
    assert not missing, f"[{table}] keys not in docs/configuration.md: {missing}"
    assert not gone, f"docs/configuration.md documents [{table}] keys the code lacks: {gone}"


@pytest.mark.parametrize("table", sorted(config_sections()))
def test_configuration_md_defaults_are_the_code_defaults(table: str) -> None:
    """A default cell holding a TOML value in backticks is the model's default; any other cell
    (``required``, ``unset``...) belongs to a key without one."""
    for key, default in keys_of(config_sections()[table]).items():
        cell = documented_tables()[table][key]
        literal = re.fullmatch(r"`(.+)`", cell)
        if literal is None:
            assert default in (None, PydanticUndefined), f"[{table}] {key}: doc says {cell!r}"
            continue
        value = tomllib.loads(f"v = {literal.group(1)}")["v"]
        expected = list(default) if isinstance(default, tuple) else default
        assert value == expected, f"[{table}] {key}: doc says {value!r}, code has {expected!r}"


def test_configuration_md_example_loads() -> None:
    """The complete file at the top of configuration.md is a config the target accepts."""
    text = (DOCS / "configuration.md").read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.S)
    assert example is not None
    raw = tomllib.loads(example.group(1).replace("…", "0" * 64))
    Settings.model_validate(raw)


# --- cli.md ------------------------------------------------------------------------------------


def commands(parser: argparse.ArgumentParser, prefix: str) -> dict[str, list[str]]:
    """Every (sub)command of ``parser`` with the options it takes, its --help left out."""
    found: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= commands(sub, f"{prefix} {name}")
    if not found:
        found[prefix] = [
            max(action.option_strings, key=len)
            for action in parser._actions
            if action.option_strings
            and action.help is not argparse.SUPPRESS
            and not isinstance(action, argparse._HelpAction)
        ]
    return found


def cli_sections() -> dict[str, str]:
    """cli.md's ``### `paddock ...` `` sections, keyed by the command words, with their text."""
    sections: dict[str, str] = {}
    name = None
    for line in (DOCS / "cli.md").read_text().splitlines():
        heading = re.match(r"#{2,3} (.*)", line)
        if heading:
            words = re.match(r"`((?:paddock-target|paddock)(?: [a-z]+)*)", heading.group(1))
            name = words.group(1) if words else heading.group(1)
            sections[name] = line + "\n"  # the heading may name an option too
        elif name is not None:
            sections[name] += line + "\n"
    return sections


SHARED = {"paddock": "Reaching a target"}
"""Options every command of a program takes, documented once."""


def all_commands() -> dict[str, list[str]]:
    return commands(build_parser(), "paddock") | commands(target_cli._parser(), "paddock-target")


@pytest.mark.parametrize("command", sorted(all_commands()))
def test_cli_md_documents_every_option_of(command: str) -> None:
    sections = cli_sections()
    assert command in sections, f"docs/cli.md has no section for `{command}`"
    shared = sections.get(SHARED.get(command.split()[0], ""), "")
    text = sections[command] + shared
    missing = [
        option
        for option in all_commands()[command]
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text)
    ]
    assert not missing, f"`{command}` options not in docs/cli.md: {missing}"


# --- the repository speaks of itself ------------------------------------------------------------


def test_nothing_points_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    outside = re.compile(rb"\.\./shared|DESIGN\.md|\bseed 00\d")
    hits = []
    for name in filter(None, tracked):
        path = ROOT / name.decode()
        if path.is_file() and path.name != "test_docs.py" and outside.search(path.read_bytes()):
            hits.append(name.decode())
    assert not hits, f"these point at documents outside the repository: {hits}"


def test_docs_links_resolve() -> None:
    for document in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", document.read_text()):
            if "://" in target:
                continue
            assert (document.parent / target).exists(), f"{document.name}: {target}"
