"""The mutations that show each security test can fail still find the code they invert.

A mutation whose code moved on would report itself stale only when someone runs it;
this checks every one of them on every run of the suite, without running any.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _mutations() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mutation_check", ROOT / "scripts" / "mutation_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutation_still_finds_the_code_it_inverts_and_names_real_tests() -> None:
    check = _mutations()
    stale, missing = [], []
    for mutation in check.MUTATIONS:
        for file, old, _ in check._replacements(mutation):
            if old not in (ROOT / file).read_text():
                stale.append(f"{mutation.name} ({file})")
        for spec in mutation.tests:
            test_file = spec.split("::")[0].split()[0]
            if not (ROOT / test_file).exists():
                missing.append(f"{mutation.name}: {test_file}")
    assert stale == [], "mutations whose code changed: " + ", ".join(stale)
    assert missing == [], "mutations naming tests that are gone: " + ", ".join(missing)


def test_mutation_names_are_unique() -> None:
    names = [m.name for m in _mutations().MUTATIONS]
    assert len(names) == len(set(names))
