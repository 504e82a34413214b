"""The engine loop: admission, continuous batching with chunked prefill, sampling, preemption."""
