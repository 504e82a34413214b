"""The one error type the CLI turns into a clear message and exit status 2."""


class UserError(Exception):
    """Bad input from the operator; the message names the field and the value."""


class KvdUnavailable(UserError):
    """kvd cannot answer now: not running, restarting, still loading or shutting down. A single
    command reports it like any error; `status --watch` keeps watching until kvd is back."""
