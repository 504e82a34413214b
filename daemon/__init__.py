"""kvd: the daemon that hosts a model over a paged KV cache (import root `kvctl.daemon`)."""
