"""kvd's HTTP surfaces: the OpenAI-compatible API, the admin API, metrics, and systemd glue."""
