"""A role home's managed entries: each class accepted exactly, every alias form refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from conftest import Target, make_settings, output, run, submit

from shared.walk import canonical_path
from target_side.config import FenceConfig, RoleHome, Settings, parse_settings
from target_side.errors import ConfigError
from target_side.policy.forbidden import role_home
from target_side.service.server import ServerThread
from target_side.tools import config_file

DIGEST = "0" * 64


def _config(home: str, fence: str = "") -> str:
    return (
        f"[fence]\n{fence}\n"
        f'[roles.a]\ntoken_sha256 = "{DIGEST}"\nworkspaces = ["/w"]\n[roles.a.home]\n{home}\n'
    )


@pytest.mark.parametrize(
    "entry",
    [
        "/srv/plugins//lint",  # the parent as written is '/srv/plugins/'
        "/srv/plugins/./lint",
        "/srv/plugins/other/../lint",
        "/srv/plugins/lint/deeper",
        "/srv/elsewhere/lint",
        "/srv/plugins/",
        "/srv/plugins/..",
    ],
)
def test_plugin_alias_forms_are_refused_not_normalised(entry: str) -> None:
    text = _config(f'plugins = ["{entry}"]', 'plugin_roots = ["/srv/plugins"]')
    with pytest.raises(ConfigError, match=r"roles\.a\.home\.plugins\[0\]"):
        parse_settings(text)


@pytest.mark.parametrize("entry", ["/etc/creds/../creds/netrc", "/etc//creds/netrc", "/etc/creds/"])
def test_credential_must_be_named_by_its_exact_path(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"credentials\[0\]"):
        parse_settings(_config(f'credentials = ["{entry}"]'))


def test_two_entries_landing_on_one_name_are_refused() -> None:
    text = _config('credentials = ["/a/netrc", "/b/netrc"]')
    with pytest.raises(
        ConfigError, match=r"credentials\[1\].*lands on netrc like credentials\[0\]"
    ):
        parse_settings(text)


def test_a_root_that_is_not_exact_is_refused() -> None:
    with pytest.raises(ConfigError, match="exact absolute path"):
        parse_settings(_config("", 'plugin_roots = ["/srv/plugins/"]'))


def test_shared_ro_says_what_replaced_it() -> None:
    text = f'[roles.a]\ntoken_sha256 = "{DIGEST}"\nworkspaces = ["/w"]\nshared_ro = ["/x"]\n'
    with pytest.raises(ConfigError, match=r"replaced by \[roles\.NAME\.home\]"):
        parse_settings(text)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = Path(canonical_path(tmp_path))
    (root / "plugins" / "lint").mkdir(parents=True)
    (root / "plugins" / "lint" / "run.sh").write_text("lint\n")
    (root / "skills" / "review").mkdir(parents=True)
    (root / "skills" / "review" / "SKILL.md").write_text("review\n")
    (root / "creds").mkdir()
    (root / "creds" / ".netrc").write_text("machine x\n")
    return root


def _fence(tree: Path) -> FenceConfig:
    return FenceConfig(
        plugin_roots=(str(tree / "plugins"),),
        skill_roots=(str(tree / "skills"),),
        plugin_dir=".agent/plugins",
    )


def _home(tree: Path) -> RoleHome:
    return RoleHome(
        credentials=(str(tree / "creds" / ".netrc"),),
        plugins=(str(tree / "plugins" / "lint"),),
        skills=(str(tree / "skills" / "review"),),
    )


def _settings(tree: Path, ca: trustme.CA, home: RoleHome) -> Settings:
    """The conftest target's settings, with ``home`` for the builder and the tree's roots."""
    base = make_settings(tree / "t", ca)
    builder = base.roles["builder"].model_copy(update={"home": home})
    data = {**base.model_dump(), "fence": _fence(tree).model_dump()}
    data["roles"] = {**data["roles"], "builder": builder.model_dump()}
    return Settings.model_validate(data)


@pytest.fixture
def managed_target(tree: Path, ca: trustme.CA) -> Iterator[Target]:
    settings = _settings(tree, ca, _home(tree))
    ca.cert_pem.write_to_path(str(tree / "ca.pem"))
    with ServerThread(settings) as server:
        yield Target(server.url, str(tree / "ca.pem"), settings, tree / "t" / "ws")


def test_each_class_appears_read_only_over_the_writable_home(managed_target: Target) -> None:
    show = (
        "cat $HOME/.netrc $HOME/.agent/plugins/lint/run.sh $HOME/.paddock/skills/review/SKILL.md; "
        "echo x >> $HOME/.netrc 2>/dev/null || echo ro-cred; "
        "touch $HOME/.agent/plugins/lint/new 2>/dev/null || echo ro-plugin; "
        "echo mine > $HOME/history && cat $HOME/history"
    )
    with managed_target.client() as c:
        turn, evs = run(c, ["sh", "-c", show])
    assert turn.exit_code == 0
    assert output(evs) == "machine x\nlint\nreview\nro-cred\nro-plugin\nmine\n"
    home = role_home(managed_target.settings, "builder")
    assert (home / "history").read_text() == "mine\n"  # the role's own, kept


def test_an_entry_that_became_a_symlink_refuses_turns_naming_it(
    managed_target: Target, tree: Path
) -> None:
    plugin = tree / "plugins" / "lint"
    plugin.rename(tree / "plugins" / "lint.real")
    plugin.symlink_to(tree / "plugins" / "lint.real")
    with managed_target.client() as c:
        turn = submit(c, argv=["true"])
    assert turn.refusal is not None
    assert (turn.refusal.rule, turn.refusal.subject) == ("bad-mount", "roles.home.plugins[0]")
    assert "is a symlink" in turn.refusal.detail


def test_config_check_names_every_entry_the_filesystem_does_not_back(
    tree: Path, ca: trustme.CA
) -> None:
    (tree / "creds" / ".netrc").unlink()
    (tree / "plugins" / "lint").rename(tree / "elsewhere")
    (tree / "plugins" / "lint").symlink_to(tree / "elsewhere")
    problems = config_file.managed_problems(_settings(tree, ca, _home(tree)))
    assert any("home.credentials[0]" in p and "does not exist" in p for p in problems)
    assert any("home.plugins[0]" in p and "is a symlink" in p for p in problems)
    assert not any("home.skills[0]" in p for p in problems)


def test_an_entry_below_a_symlinked_directory_is_refused(tree: Path, ca: trustme.CA) -> None:
    (tree / "real-creds").mkdir()
    (tree / "real-creds" / "token").write_text("t\n")
    (tree / "linked-creds").symlink_to(tree / "real-creds")
    home = RoleHome(credentials=(str(tree / "linked-creds" / "token"),))
    (problem,) = config_file.managed_problems(_settings(tree, ca, home))
    assert "lies below a symlink" in problem
