"""paddock_deploy.supervisor: installed as it is, it trusts only settings root wrote.

Root runs ``paddock-supervise`` and signals the processes its settings lead
to: a settings file someone else could have written would aim root elsewhere.
The supervisor at work (start, restart, stop) is tested by the deploy tests.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from deploy_support import DEPLOY_DIR, SYSTEM_PYTHON

from paddock_deploy.supervisor import SETTINGS_KEYS, Settings, SettingsError

SETTINGS = {
    "user": "paddock",
    "prefix": "/opt/paddock",
    "config": "/etc/paddock/target.toml",
    "run_dir": "/var/lib/paddock/supervisor",
    "launcher_dir": "/opt/paddock/launcher",
    "python": SYSTEM_PYTHON,
}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the settings must belong to root")


def _script(tmp_path: Path, settings: object = SETTINGS, mode: int = 0o644) -> str:
    script = tmp_path / "paddock-supervise"
    script.write_bytes((DEPLOY_DIR / "paddock_deploy" / "supervisor.py").read_bytes())
    settings_file = tmp_path / "paddock-supervise.json"
    settings_file.write_text(json.dumps(settings))
    settings_file.chmod(mode)
    return str(script)


@as_root
def test_supervisor_reads_the_settings_root_wrote_beside_it(tmp_path: Path) -> None:
    script = _script(tmp_path)
    loaded = Settings.beside(script)
    assert loaded == Settings(script=script, **SETTINGS)
    assert set(SETTINGS) == set(SETTINGS_KEYS)


@as_root
def test_supervisor_refuses_settings_others_could_have_written(tmp_path: Path) -> None:
    script = _script(tmp_path, mode=0o666)
    with pytest.raises(SettingsError, match="not writable by others"):
        Settings.beside(script)
    os.chmod(script + ".json", 0o644)
    os.chown(script + ".json", 1, 1)
    with pytest.raises(SettingsError, match="regular file of root's"):
        Settings.beside(script)


@as_root
def test_supervisor_refuses_settings_behind_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    script = _script(real)
    (tmp_path / "paddock-supervise").symlink_to(script)
    (tmp_path / "paddock-supervise.json").symlink_to(script + ".json")
    with pytest.raises(SettingsError, match="cannot read"):
        Settings.beside(str(tmp_path / "paddock-supervise"))


@as_root
@pytest.mark.parametrize(
    "settings",
    [{**SETTINGS, "extra": "x"}, {k: v for k, v in SETTINGS.items() if k != "user"}, [1]],
)
def test_supervisor_refuses_settings_that_are_not_exactly_its_keys(tmp_path, settings) -> None:
    with pytest.raises(SettingsError, match="must hold exactly"):
        Settings.beside(_script(tmp_path, settings))


def test_supervisor_runs_as_a_file_of_its_own_and_says_what_is_wrong(tmp_path: Path) -> None:
    script = tmp_path / "paddock-supervise"
    script.write_bytes((DEPLOY_DIR / "paddock_deploy" / "supervisor.py").read_bytes())
    proc = subprocess.run(
        [SYSTEM_PYTHON, "-I", str(script), "status"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr == f"paddock-supervise: cannot read {script}.json: No such file or directory\n"
    )
    usage = subprocess.run(
        [SYSTEM_PYTHON, "-I", str(script), "bogus"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert usage.returncode == 2 and "start|stop|restart|status" in usage.stderr
