"""The service: the HTTP API, the turns it runs, their spools, records and ledger, and health."""
