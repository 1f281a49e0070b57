"""paddock-deploy: install, upgrade and check a paddock target on this machine, as root.

Standard library only: a fresh target has nothing else yet. The agent side
builds this package into one file (``archive.py``: a zipapp), uploads it with
a paddock wheel and runs ``python3 paddock-deploy.pyz --wheel W --role R --json``;
deploy/README.md has the whole interface.

Every step is idempotent and says "nothing to do" when the host already
matches. Each change registers its undo, and a failure at any step (or a lost
output channel, or a signal) undoes this run's changes in reverse order, so
the previous install keeps serving. The package goes into a release
directory of its own, and ``PREFIX/current`` is switched to it atomically
only once everything it needs is in place.

    protocol      steps, exit statuses, event lines, passed options (shared with the agent side)
    cli           the command line          runner      the steps in order, rollback, the result
    context       one run's state           transaction changes and their undo
    progress      step lines and heartbeats errors      the exception tree
    steps/        one module per step       supervisor  paddock-supervise, installed as it is
    systemd_unit  the hardened unit         archive     the zipapp build
    commands, files, service_user, addresses    what the steps share
"""
