"""/metrics under vLLM's and SGLang's names (metrics_aliases): each alias equals kvd's own figure."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .daemon_fixtures import apps, call, settled, start_service, token_table  # noqa: E402


def sample(text: str, name: str, labels: str = "") -> float:
    shown = f"{name}{{{labels}}}" if labels else name
    match = re.search(rf"^{re.escape(shown)} (\S+)$", text, re.MULTILINE)
    assert match, f"{shown} not exported"
    return float(match.group(1))


def test_vllm_and_sglang_names_carry_kvd_s_figures(tmp_path):
    service = start_service(tmp_path, num_blocks=64, metrics_aliases="vllm,sglang")
    try:
        unix, _ = apps(service, token_table(tmp_path))
        prompt = list(range(1, 40))
        for max_tokens in (3, 5):  # the second hits the first's two full blocks
            body = call(unix, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                              "temperature": 0, "ignore_eos": True}).json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        # the last request's client has its answer just before kvd's metrics take the request
        text = settled(lambda: call(unix, "GET", "/metrics").text,
                       lambda text: sample(text, "kvd_inter_token_seconds_count") == 2 + 4)
        model = f'model_name="{service.model_name}"'
        assert sample(text, "vllm:prefix_cache_queries_total", model) == sample(text, "kvd_prompt_tokens_total") == 78
        assert sample(text, "vllm:prefix_cache_hits_total", model) == sample(text, "kvd_prefix_hit_tokens_total") == 32
        assert sample(text, "vllm:generation_tokens_total", model) == sample(text, "kvd_generation_tokens_total") == 8
        assert sample(text, "vllm:request_success_total", 'finished_reason="length",' + model) == 2
        assert sample(text, "vllm:num_requests_running", model) == sample(text, "vllm:num_requests_waiting", model) == 0
        assert sample(text, "vllm:kv_cache_usage_perc", model) == 0.0  # nothing held: cached blocks are free to vLLM
        assert sample(text, "vllm:time_to_first_token_seconds_count", model) == sample(text, "kvd_ttft_seconds_count") == 2
        assert sample(text, "vllm:inter_token_latency_seconds_count", model) == 2 + 4
        assert sample(text, "vllm:time_to_first_token_seconds_bucket", 'le="+Inf",' + model) == 2
        assert sample(text, "sglang:cache_hit_rate", model) == pytest.approx(32 / 78)
        assert sample(text, "sglang:evicted_tokens_total", model) == 0
        assert sample(text, "sglang:token_usage", model) == 0.0
    finally:
        service.shutdown(1)


def test_no_aliases_unless_asked(tmp_path):
    service = start_service(tmp_path, num_blocks=16)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        text = call(unix, "GET", "/metrics").text
        assert "vllm:" not in text and "sglang:" not in text and "kvd_prompt_tokens_total" in text
    finally:
        service.shutdown(1)
