"""The one error type the CLI turns into a clear message and exit status 2."""


class UserError(Exception):
    """Bad input from the operator; the message names the field and the value."""
