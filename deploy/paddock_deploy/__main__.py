"""``python3 -m paddock_deploy`` (with ``deploy/`` on the path) runs the deploy from a checkout."""

import sys

from paddock_deploy.cli import main

sys.exit(main())
