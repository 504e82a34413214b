"""kvctl: operations toolkit for the KV cache of LLM serving (CLI, client, and the kvd daemon)."""

__version__ = "0.1.0"
