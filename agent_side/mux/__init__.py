"""The local multiplexer: one background process per user and target keeps its connections warm.

    paddock run ──unix socket──▶ paddock mux serve NAME ──HTTPS, or SSH──▶ target
    (standard library only;      (holds the HTTP pool and the SSH connection;
     sends the request, copies    submits, follows and resumes each turn; leaves
     output, signals, stdin)      after --mux-persist with no client)

Like OpenSSH's ControlMaster/ControlPersist: the first ``paddock run`` for a
target starts it, later ones skip the interpreter's heavy imports and every
handshake. ``--no-mux`` (or ``PADDOCK_NO_MUX=1``) runs as before, in-process.

    paths      where sockets live, and what is checked before one is trusted
    frames     the protocol: a JSON line, then as many raw bytes as it says
    settings   --no-mux, --mux-persist and their variables
    client     paddock run's side: find or start the daemon, relay one turn
    daemon     paddock mux serve: accept, check the peer, open targets, leave when idle
    relay      one turn in the daemon, through the same code as an in-process run
    command    paddock mux status|stop|serve, and run's options

Messages from ``paddock run`` to the daemon: ``op: run`` (the route, token,
role, request options, stdin mode, --json), then ``t: signal`` (INT, KILL or
TERM), ``t: stdin`` (+ bytes), ``t: stdin-eof``, ``t: passphrase`` (an answer).
From the daemon: ``accepted``, ``stdout``/``stderr`` (+ bytes), ``say`` (a
``paddock: ...`` line), ``ack`` (a stdin chunk written), ``passphrase`` (a
question), then ``exit`` (the status) or ``error`` (an ``AgentError``'s class
and message). ``op: status`` and ``op: stop`` serve ``paddock mux``.

The token travels only inside the socket, per request; it is never on a
command line, in the socket's name, in the daemon's environment or its log.
"""
