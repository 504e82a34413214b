"""kvd's figures under the metric names vLLM and SGLang export, so that dashboards and alerts
built for them keep working on kvd (`metrics_aliases: vllm,sglang`; off by default).

Each alias is computed from the same books as kvd's own families, at scrape time:

    vllm:num_requests_running / vllm:num_requests_waiting      requests in the batch / queued
    vllm:kv_cache_usage_perc       blocks held by requests (reserved, active, shared) ÷ all blocks,
                                   0-1, as vLLM counts it (cached idle blocks are free to it)
    vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   prompt tokens / served from cache
    vllm:num_preemptions_total, vllm:prompt_tokens_total, vllm:generation_tokens_total
    vllm:request_success_total{finished_reason}                stop, length, abort (a cancelled sample)
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds   histograms (kvd's buckets)
    vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
    vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
                                   speculative decoding (speculative_config), as kvd_spec_decode_* count it
    sglang:num_running_reqs / sglang:num_queue_reqs, sglang:token_usage (as vLLM's usage),
    sglang:cache_hit_rate (hit ÷ prompt tokens since start), sglang:evicted_tokens_total

Every alias carries `model_name`, the served model's name, as theirs do.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .engine_liveness import held_for_scrape

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


def _labelled(kind, model: str):
    """A maker of one-sample families of `kind` (gauge or counter) labelled with the model's name."""
    def make(name: str, doc: str, value: float):
        family = kind(name, doc, labels=["model_name"])
        family.add_metric([model], value)
        return family
    return make


class AliasCollector:
    """Yields the chosen alias sets' families from the service and kvd's own metrics."""

    def __init__(self, service, metrics, sets: tuple[str, ...]) -> None:
        self.service, self.metrics, self.sets = service, metrics, sets

    def collect(self):
        engine = self.service.engine
        if engine is None:
            return
        with held_for_scrape(self.service.lock, self.service.engine_loop) as had:
            if not had:  # kvd's own families say why (kvd_engine_stalled)
                return
            counts = engine.cache.state_counts()
            stats = engine.stats
            figures = {"running": engine.num_running, "waiting": len(engine.waiting()),
                       "prompt": stats.prompt_tokens, "hit": stats.hit_tokens, "preemptions": stats.preemptions,
                       "evicted_blocks": engine.cache.pool.evictions, "block_size": engine.cache.block_size,
                       "total": engine.cache.num_blocks, "speculation": engine.speculator.stats.describe()}
        held = counts["reserved"] + counts["active"] + counts["shared"]
        figures["usage"] = held / figures["total"] if figures["total"] else 0.0
        model = self.service.model_name or "kvd"
        if "vllm" in self.sets:
            yield from self._vllm(figures, model)
        if "sglang" in self.sets:
            yield from self._sglang(figures, model)

    def _vllm(self, f: dict, model: str):
        gauge, counter = _labelled(GaugeMetricFamily, model), _labelled(CounterMetricFamily, model)
        yield gauge("vllm:num_requests_running", "Requests in the batch (kvd)", f["running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission (kvd)", f["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV cache blocks held by requests, 0-1 (kvd)", f["usage"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (kvd)", f["prompt"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache (kvd)", f["hit"])
        yield counter("vllm:num_preemptions", "Preemptions (kvd)", f["preemptions"])
        yield counter("vllm:prompt_tokens", "Prompt tokens of admitted requests (kvd)", f["prompt"])
        yield counter("vllm:generation_tokens", "Output tokens (kvd)", self.metrics.generated_tokens())
        success = CounterMetricFamily("vllm:request_success", "Samples finished, by reason (kvd)",
                                      labels=["model_name", "finished_reason"])
        for reason, value in sorted(self.metrics.finished_by_reason().items()):
            success.add_metric([model, FINISH_REASONS.get(reason, reason)], value)
        yield success
        yield self._renamed(self.metrics.ttft, "vllm:time_to_first_token_seconds", model)
        yield self._renamed(self.metrics.itl, "vllm:inter_token_latency_seconds", model)
        spec = f["speculation"]
        yield counter("vllm:spec_decode_num_drafts", "Speculative drafts (kvd)", spec["drafts"])
        yield counter("vllm:spec_decode_num_draft_tokens", "Speculative tokens drafted (kvd)", spec["draft_tokens"])
        yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted (kvd)",
                      spec["accepted_tokens"])
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted speculative "
                                           "tokens per draft position (kvd)", labels=["model_name", "position"])
        for position, value in enumerate(spec["accepted_per_position"]):
            per_position.add_metric([model, str(position)], value)
        yield per_position

    def _sglang(self, f: dict, model: str):
        gauge, counter = _labelled(GaugeMetricFamily, model), _labelled(CounterMetricFamily, model)
        yield gauge("sglang:num_running_reqs", "Requests in the batch (kvd)", f["running"])
        yield gauge("sglang:num_queue_reqs", "Requests waiting for admission (kvd)", f["waiting"])
        yield gauge("sglang:token_usage", "KV cache blocks held by requests, 0-1 (kvd)", f["usage"])
        yield gauge("sglang:cache_hit_rate", "Prompt tokens served from the prefix cache since start, 0-1 (kvd)",
                    f["hit"] / f["prompt"] if f["prompt"] else 0.0)
        yield counter("sglang:evicted_tokens", "Tokens of evicted cache blocks (kvd)",
                      f["evicted_blocks"] * f["block_size"])

    @staticmethod
    def _renamed(histogram, name: str, model: str) -> HistogramMetricFamily:
        """One of kvd's histograms under another name, with `model_name`."""
        (family,) = histogram.collect()
        buckets, total = [], 0.0
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                buckets.append((sample.labels["le"], sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
        out = HistogramMetricFamily(name, family.documentation + " (kvd)", labels=["model_name"])
        out.add_metric([model], buckets, total)
        return out
