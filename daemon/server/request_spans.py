"""OpenTelemetry traces of kvd's requests (`otlp_traces_endpoint`, vLLM's `--otlp-traces-endpoint`):
a span per request, sent over OTLP/HTTP to a collector (Jaeger, Tempo, an OpenTelemetry Collector).

A span is made when the request has finished (or was turned away), from the engine's own times,
so the engine's step never waits on it: it starts when the request arrived and ends with its last
token, with an event where it was admitted and one at its first token. Its parent is the caller's
span where the request carried W3C trace context (`traceparent`, `tracestate`), which kvd router
passes on, so a client's trace runs through the router to the replica's queue and cache.

Attributes follow OpenTelemetry's GenAI conventions where they have a name (`gen_ai.request.model`,
`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`, `gen_ai.response.finish_reasons`, ...),
and `kvd.*` for the cache's part: cached, restored and recomputed tokens, preemptions, the queue
and first-token times, the tenant, the rollout cohort. Never the prompt's text, the output's, or a
token id. A turned-away request's span has an error status naming the limit it met.

The exporter is OpenTelemetry's own (otlp_export.py: OTLP over HTTP, or gRPC), batched off the
engine's thread; its usual environment variables (OTEL_EXPORTER_OTLP_HEADERS, OTEL_SERVICE_NAME,
...) apply.
"""

from __future__ import annotations

import time

from .request_log import request_fields

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as the caller sent it
SPAN_IDS = "span_ids"  # params.extra: the request's span's (trace id, span id), hex, once it has one


def exemplar_of(request) -> dict | None:
    """The labels of an exemplar that links a request's figure in /metrics to its span (OpenMetrics:
    Grafana jumps from a slow bucket to the trace), or None where the request has no span."""
    ids = request.params.extra.get(SPAN_IDS)
    return {"trace_id": ids[0], "span_id": ids[1]} if ids else None


def trace_context(headers) -> dict | None:
    """The W3C trace context a request carried (its headers), or None."""
    found = {name: headers[name] for name in TRACE_HEADERS if headers.get(name)}
    return found or None


def span_attributes(request, model: str) -> dict:
    """A finished request's attributes (engine.requests.Request): counts, times and names, no text."""
    fields = request_fields(request, model)
    params = request.params
    attributes = {
        "gen_ai.system": "kvd", "gen_ai.operation.name": "chat" if fields["api"] == "chat" else "text_completion",
        "gen_ai.request.model": fields["model"], "gen_ai.response.model": fields["model"],
        "gen_ai.request.id": fields["request_id"], "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.n": params.n, "gen_ai.usage.input_tokens": fields["prompt_tokens"],
        "gen_ai.usage.output_tokens": fields["output_tokens"],
        "gen_ai.response.finish_reasons": tuple(fields["finish"].split(",")),
        "kvd.api": fields["api"], "kvd.tenant": fields["tenant"], "kvd.cached_tokens": fields["cached_tokens"],
        "kvd.restored_tokens": fields["restored_tokens"], "kvd.recomputed_tokens": fields["recomputed_tokens"],
        "kvd.preemptions": fields["preemptions"]}
    for name in ("queued_s", "ttft_s", "e2e_s", "cohort", "client_request_id"):
        if fields.get(name) is not None:
            attributes[f"kvd.{name}"] = fields[name]
    return attributes


class RequestSpans:
    """Spans of one kvd's requests, given to `processor` (the OTLP exporter, batched; a test's
    in-memory one). `engine_clock` reads the clock the engine stamps requests with."""

    def __init__(self, service, processor, engine_clock=time.monotonic) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from kvctl import __version__

        self.service = service
        self.engine_clock = engine_clock
        self.provider = TracerProvider(resource=Resource.create({"service.name": "kvd",
                                                                 "service.version": __version__}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvd")
        self.propagator = TraceContextTextMapPropagator()

    def _ns(self, engine_time: float, offset: float) -> int:
        return int((engine_time + offset) * 1e9)

    def observe(self, request) -> None:
        """A request finished (EngineService calls it before its on_finished observers, which may
        then read the span's ids: exemplar_of): its span, from arrival to its last token."""
        if request.params.extra.get("api") is None:
            return  # a pin's warm-up is nobody's request
        self._span(request)

    def rejected(self, request, kind: str) -> None:
        """A request turned away at admission: its span, with an error status naming the limit
        (`kind`, which the request carries as rejected_kind)."""
        self._span(request)

    def _span(self, request) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        offset = time.time() - self.engine_clock()  # the engine's clock to the wall's
        metrics = request.metrics
        carried = request.params.extra.get("trace_context")
        parent = self.propagator.extract(carrier=carried) if carried else None
        attributes = span_attributes(request, self.service.model_name)
        rejected = request.rejected_kind  # at admission, or later from the queue
        if rejected:
            attributes["kvd.rejected"] = rejected
        span = self.tracer.start_span("kvd.request", context=parent, kind=SpanKind.SERVER,
                                      start_time=self._ns(metrics.arrival, offset), attributes=attributes)
        ids = span.get_span_context()
        request.params.extra[SPAN_IDS] = (f"{ids.trace_id:032x}", f"{ids.span_id:016x}")  # exemplars (metrics.py)
        for name, at in (("admitted", metrics.admitted), ("first_token", metrics.first_token)):
            if at is not None:
                span.add_event(name, timestamp=self._ns(at, offset))
        if rejected:
            span.set_status(Status(StatusCode.ERROR, f"rejected: {rejected}"))
        elif "error" in attributes["gen_ai.response.finish_reasons"]:
            span.set_status(Status(StatusCode.ERROR, "a sample ended in error"))
        ended = metrics.token_times[-1] if metrics.token_times else None
        span.end(end_time=self._ns(ended, offset) if ended is not None else None)

    def shutdown(self) -> None:
        """Send what is batched, then stop (kvd's shutdown)."""
        self.provider.shutdown()


def install(service, processor) -> RequestSpans:
    """Give `service` (an EngineService) spans of its requests, handed to `processor`."""
    spans = RequestSpans(service, processor)
    service.request_spans = spans  # observed as each request finishes, before the on_finished observers
    service.on_rejected(spans.rejected)
    return spans
