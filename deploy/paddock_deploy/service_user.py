"""The service user: who it is, and running a command as it (as the server itself runs)."""

from __future__ import annotations

import contextlib
import grp
import os
from dataclasses import dataclass

from paddock_deploy.commands import run
from paddock_deploy.supervisor import drop_privileges, server_env


@dataclass(frozen=True)
class Account:
    """The service user."""

    name: str
    uid: int
    gid: int
    home: str


def as_user(account: Account) -> list[str]:
    """The prefix that runs a command as the service user: no capabilities, no_new_privs."""
    return drop_privileges(account.uid, account.gid)


def user_env(account: Account) -> dict[str, str]:
    return server_env(account.name, account.home)


def writable_by(st: os.stat_result, account: Account) -> bool:
    """Whether ``account`` may create files in a directory with stat ``st``."""
    groups = {account.gid} | {g.gr_gid for g in grp.getgrall() if account.name in g.gr_mem}
    if st.st_uid == account.uid:
        bits = 0o300
    elif st.st_gid in groups:
        bits = 0o030
    else:
        bits = 0o003
    return st.st_mode & bits == bits


def remove_user(name: str) -> None:
    run(["userdel", name])
    with contextlib.suppress(KeyError):
        grp.getgrnam(name)
        run(["groupdel", name])
