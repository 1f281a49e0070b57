"""Where a default deploy puts the target's files: read by both sides, importing nothing.

The agent side reads these on its fastest path (``paddock run --ssh`` pins the
CA it finds at ``CA_FILE``), so this module stays free of imports.
"""

CONFIG_DIR = "/etc/paddock"
CONFIG_FILE = f"{CONFIG_DIR}/target.toml"
CA_FILE = f"{CONFIG_DIR}/tls/ca.pem"
