"""Pure decision logic for the KV cache: eviction, output reservation, admission.

Nothing here imports the rest of the project or reads the wall clock: callers
pass plain data and a clock value, so replays are deterministic.
"""
