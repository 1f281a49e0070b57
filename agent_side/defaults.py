"""Where ``paddock deploy`` puts a target, which ``--ssh`` assumes when told nothing else."""

DEFAULT_SSH_TARGET = "https://127.0.0.1:8443"
"""The target's listener as seen from the SSH server: where ``paddock deploy`` puts it."""
REMOTE_CA = "/etc/paddock/tls/ca.pem"
"""Where ``paddock deploy`` leaves the CA of the certificate it makes (``--config-dir``/tls)."""
