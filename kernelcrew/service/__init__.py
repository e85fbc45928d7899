"""The job domain shared by the API, the web UI and the orchestrators: jobs, users, tokens, auth.

Modules: ``jobs`` (the service's tables and their operations: tokens, leases, job events),
``auth`` (who a request acts for), ``submissions`` (the checks and writes behind a submitted job
or a chat message), ``summary`` (what a job's list entry says: name, verdict, speedup, answer),
``listing`` (a user's job list and its filters), ``events`` (a job's events as a stream) and
``webhooks`` (the signed POST when a job ends). Importing this package imports
none of them, nor FastAPI.
"""
