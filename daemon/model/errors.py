"""The error a checkpoint that cannot be used raises (its own module: config and rope both raise it)."""


class ModelError(ValueError):
    """The checkpoint cannot be used; the message names the file, field or tensor."""
