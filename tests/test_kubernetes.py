"""The Kubernetes manifests in deploy/kubernetes/, checked offline (no cluster runs here).

They are parsed as YAML and held to what deploy/README.md promises: nothing
privileged, no privilege escalation, read-only root filesystems, every
capability dropped (the init container adds back only what it names), the
server non-root as the image's own user, exactly the exceptions bubblewrap
needs and only on the server; and they agree with the code: the ConfigMap's
target.toml loads with the target's own config parser, and the image, the
command, the paths and the ports are the same everywhere they appear.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from target_side.config import Settings, parse_settings, split_listen

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "deploy" / "kubernetes"
WORKLOADS = ("DaemonSet", "Deployment")
INIT_CAPABILITIES = {"CHOWN", "FOWNER", "DAC_OVERRIDE"}
"""What the init container may add back, each for one line of its script (see its comment)."""


def _documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return found


DOCUMENTS = _documents()


def _one(kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in DOCUMENTS if doc["kind"] == kind]
    return found


def _pod(kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = _one(kind)["spec"]["template"]["spec"]
    return spec


def _containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def _server(pod: dict[str, Any]) -> dict[str, Any]:
    (server,) = pod["containers"]
    return dict(server)


def _init(pod: dict[str, Any]) -> dict[str, Any]:
    (init,) = pod["initContainers"]
    return dict(init)


def _settings() -> Settings:
    text = _one("ConfigMap")["data"]["target.toml"]
    return parse_settings(text, "configmap.yaml:target.toml")


def _containerfile() -> dict[str, Any]:
    text = (MANIFESTS / "Containerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert user and entrypoint and cmd, "the Containerfile needs USER, ENTRYPOINT and CMD"
    return {
        "uid": int(user.group(1)),
        "gid": int(user.group(2)),
        "entrypoint": yaml.safe_load(entrypoint.group(1)),
        "cmd": yaml.safe_load(cmd.group(1)),
    }


def _installed(pod: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """What the init script installs: destination -> (owner, group, mode)."""
    script = "\n".join(_init(pod)["args"])
    found = {}
    for line in script.splitlines():
        words = shlex.split(line)
        if not words or words[0] != "install":
            continue
        options: dict[str, str] = {}
        operands: list[str] = []
        rest = iter(words[1:])
        for word in rest:
            if word in ("-o", "-g", "-m"):
                options[word] = next(rest)
            elif word.startswith("-"):
                options[word] = ""
            else:
                operands.append(word)
        destinations = operands if "-d" in options else operands[-1:]
        for destination in destinations:
            found[destination] = (options["-o"], options["-g"], options["-m"])
    return found


def _mounted(container: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume mount ``path`` lies on in ``container`` (the deepest), if any."""
    mounts = [
        m
        for m in container.get("volumeMounts", [])
        if PurePosixPath(path).is_relative_to(m["mountPath"])
    ]
    return max(mounts, key=lambda m: len(m["mountPath"]), default=None)


# --- the set of manifests ------------------------------------------------------------------


def test_kubernetes_manifests_are_the_ones_documented() -> None:
    kinds = sorted(doc["kind"] for doc in DOCUMENTS)
    assert kinds == sorted(
        [
            "ConfigMap",
            "DaemonSet",
            "Deployment",
            "Namespace",
            "PersistentVolumeClaim",
            "Secret",
            "Service",
        ]
    )
    namespace = _one("Namespace")["metadata"]["name"]
    for doc in DOCUMENTS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, doc["kind"]
    readme = (REPO / "deploy" / "README.md").read_text()
    for path in MANIFESTS.iterdir():
        assert f"kubernetes/{path.name}" in readme, f"deploy/README.md does not name {path.name}"


def test_kubernetes_namespace_enforces_nothing_it_does_not_need_to_and_audits_restricted() -> None:
    labels = _one("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"


# --- the pods' security ------------------------------------------------------------------


@pytest.mark.parametrize("kind", WORKLOADS)
def test_kubernetes_nothing_is_privileged_or_escalates_or_writes_its_root(kind: str) -> None:
    pod = _pod(kind)
    assert pod["hostUsers"] is False  # root in the pod is not root on the node
    assert pod["automountServiceAccountToken"] is False
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(key), key
    for container in _containers(pod):
        context = container["securityContext"]
        assert context.get("privileged", False) is False, container["name"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
    assert "privileged: true" not in (MANIFESTS / f"{kind.lower()}.yaml").read_text()


@pytest.mark.parametrize("kind", WORKLOADS)
def test_kubernetes_server_runs_as_the_images_own_user_with_no_capability(kind: str) -> None:
    pod = _pod(kind)
    image = _containerfile()
    context = _server(pod)["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (context["runAsUser"], context["runAsGroup"]) == (image["uid"], image["gid"])
    assert pod["securityContext"]["runAsUser"] == image["uid"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "add" not in context["capabilities"]


@pytest.mark.parametrize("kind", WORKLOADS)
def test_kubernetes_bubblewraps_exceptions_are_on_the_server_only(kind: str) -> None:
    pod = _pod(kind)
    server = _server(pod)["securityContext"]
    # Exactly what every fence needs (deploy/README.md): a fresh /proc, unshare and mount.
    assert server["procMount"] == "Unmasked"
    assert server["seccompProfile"] == {"type": "Unconfined"}
    assert server["appArmorProfile"] == {"type": "Unconfined"}
    # Everything else keeps the runtime's filter.
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    init = _init(pod)["securityContext"]
    assert "seccompProfile" not in init and "appArmorProfile" not in init
    assert init.get("procMount", "Default") == "Default"


@pytest.mark.parametrize("kind", WORKLOADS)
def test_kubernetes_init_adds_back_only_what_its_script_needs(kind: str) -> None:
    pod = _pod(kind)
    init = _init(pod)
    context = init["securityContext"]
    assert set(context["capabilities"]["add"]) <= INIT_CAPABILITIES
    # Root only inside the pod's own user namespace (hostUsers: false, checked above).
    assert context["runAsUser"] == 0
    uid = _server(pod)["securityContext"]["runAsUser"]
    for destination, (owner, group, mode) in _installed(pod).items():
        assert group == str(uid), destination
        assert owner in ("0", str(uid)), destination
        assert not int(mode, 8) & 0o007, f"{destination}: others get nothing ({mode})"


# --- agreement with the code -------------------------------------------------------------------


def test_kubernetes_config_loads_with_the_targets_own_parser() -> None:
    settings = _settings()
    assert set(settings.roles) == {"builder"}
    # No real token in a checked-in file: the placeholder hash nobody holds a token for.
    assert settings.roles["builder"].token_sha256 == "0" * 64
    # Listening beyond loopback, so TLS is on (the parser insists on it as well).
    assert settings.server.tls_cert and settings.server.tls_key
    # A server that is not root runs turns as its own uid (or through a launcher).
    assert settings.fence.identity == "server" or settings.fence.launcher is not None


@pytest.mark.parametrize("kind", WORKLOADS)
def test_kubernetes_paths_ports_and_image_agree_everywhere(kind: str) -> None:
    pod = _pod(kind)
    settings = _settings()
    server = _server(pod)
    image = _containerfile()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for container in _containers(pod):
        assert container["image"] == f"paddock-target:{version}", container["name"]
    assert server["command"] == image["entrypoint"]
    assert server["args"] == image["cmd"]
    config = server["args"][server["args"].index("--config") + 1]
    installed = _installed(pod)
    # The config and the TLS pair are where the init container put them, on a volume both see.
    for path in (config, settings.server.tls_cert, settings.server.tls_key):
        assert path in installed, path
        mount = _mounted(server, str(path))
        assert mount is not None and mount.get("readOnly") is True, path
        assert mount["name"] in {m["name"] for m in _init(pod)["volumeMounts"]}
    assert installed[str(settings.server.tls_key)][2] == "0600"  # the target demands it
    for path in (settings.server.state_root, *settings.roles["builder"].workspaces):
        mount = _mounted(server, path)
        assert mount is not None and not mount.get("readOnly"), path
        assert path in installed, path  # made the server's own by the init container
    volumes = {v["name"] for v in pod["volumes"]}
    used = {m["name"] for c in _containers(pod) for m in c["volumeMounts"]}
    assert used == volumes
    assert _mounted(server, "/tmp") is not None  # the root filesystem is read-only
    _, port = split_listen(settings.server.listen)
    (https,) = server["ports"]
    assert https["containerPort"] == port
    for probe in ("readinessProbe", "livenessProbe"):
        get = server[probe]["httpGet"]
        assert (get["port"], get["scheme"], get["path"]) == (https["name"], "HTTPS", "/v1/health")


def test_kubernetes_deployment_is_one_target_behind_its_service() -> None:
    deployment = _one("Deployment")["spec"]
    assert deployment["replicas"] == 1
    assert deployment["strategy"]["type"] == "Recreate"
    service = _one("Service")["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    daemon_labels = _one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert not service["selector"].items() <= daemon_labels.items()
    (port,) = service["ports"]
    assert port["targetPort"] == _server(_pod("Deployment"))["ports"][0]["name"]
    claim = _one("PersistentVolumeClaim")["metadata"]["name"]
    state = [v for v in _pod("Deployment")["volumes"] if v["name"] == "state"]
    assert state[0]["persistentVolumeClaim"]["claimName"] == claim


def test_kubernetes_tls_secret_is_mounted_read_only_into_the_init_container_alone() -> None:
    secret = _one("Secret")
    assert secret["type"] == "kubernetes.io/tls"
    assert set(secret["data"]) == {"tls.crt", "tls.key"}
    assert not any(secret["data"].values())  # no key material checked in
    for kind in WORKLOADS:
        pod = _pod(kind)
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert volume["secret"]["defaultMode"] == 0o400
        readers = [c for c in _containers(pod) if _named(c, volume["name"])]
        assert [c["name"] for c in readers] == [_init(pod)["name"]]
        assert all(_named(c, volume["name"])["readOnly"] for c in readers)


def _named(container: dict[str, Any], volume: str) -> dict[str, Any] | None:
    return next((m for m in container.get("volumeMounts", []) if m["name"] == volume), None)
