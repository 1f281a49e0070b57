"""Where ``paddock deploy`` puts a target, which ``--ssh`` assumes when told nothing else."""

from paddock_deploy.places import CA_FILE

DEFAULT_SSH_TARGET = "https://127.0.0.1:8443"
"""The target's listener as seen from the SSH server: where ``paddock deploy`` puts it."""
REMOTE_CA = CA_FILE
"""Where ``paddock deploy`` leaves the CA of the certificate it makes (``--config-dir``/tls)."""
