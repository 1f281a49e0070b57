"""How the ``paddock`` command shows what the target answered (agent_side.views)."""

from __future__ import annotations

import pytest

from agent_side.views import refusal_sentence, say
from shared.wire import Refusal


def test_refusal_sentence_names_rule_subject_path_and_resolution() -> None:
    refusal = Refusal(
        rule="forbidden-path",
        subject="fs.read[0]",
        path="/home/u/keys",
        resolved="/home/u/.ssh",
        detail="/home/u/.ssh is forbidden: it holds credentials; drop it from --read.",
    )
    assert refusal_sentence(refusal) == (
        "refused (forbidden-path, fs.read[0]): /home/u/.ssh is forbidden: it holds credentials; "
        "drop it from --read (path /home/u/keys resolves to /home/u/.ssh)."
    )


def test_refusal_sentence_with_one_path_or_none() -> None:
    same = Refusal(rule="bad-mount", subject="secrets[0]", path="/x", resolved="/x", detail="Gone")
    assert refusal_sentence(same) == "refused (bad-mount, secrets[0]): Gone (path /x)."
    bare = Refusal(rule="reserved-env", subject="env.PADDOCK_X", detail="PADDOCK_ is reserved.")
    expected = "refused (reserved-env, env.PADDOCK_X): PADDOCK_ is reserved."
    assert refusal_sentence(bare) == expected


def test_refused_network_says_drop_net_not_the_wire_words() -> None:
    refusal = Refusal(
        rule="network-not-allowed",
        subject="network",
        detail="role 'builder' does not allow network access; ask for network \"none\", "
        "or have the operator set allow_network for the role",
    )
    sentence = refusal_sentence(refusal)
    assert sentence == (
        "refused (network-not-allowed, network): role 'builder' does not allow network access; "
        "drop --net, or have the operator set allow_network for the role."
    )
    assert '"none"' not in sentence


@pytest.mark.parametrize(
    ("subject", "fix"),
    [
        ("fs.write[1]", "create it on the target, or give --write an existing directory"),
        ("cwd", "create it on the target, or give --cwd an existing directory"),
        ("fs.read[0]", "create it on the target, or give --read an existing path"),
    ],
)
def test_refused_missing_path_says_how_to_fix_it(subject: str, fix: str) -> None:
    refusal = Refusal(
        rule="bad-mount",
        subject=subject,
        path="/srv/work/out",
        resolved="/srv/work/out",
        detail="/srv/work/out is not an existing directory",
    )
    assert refusal_sentence(refusal) == (
        f"refused (bad-mount, {subject}): /srv/work/out is not an existing directory; "
        f"{fix} (path /srv/work/out)."
    )


def test_say_makes_control_characters_visible(capsys: pytest.CaptureFixture[str]) -> None:
    say("refused: \x1b[2Jgone\nfake line\r")
    assert capsys.readouterr().err == "paddock: refused: \\x1b[2Jgone\\nfake line\\r\n"
