"""OpenTelemetry traces of kvd router's routing (`kvd router --otlp-traces-endpoint`): where each
request went, how long that took, and which replicas turned it away first.

A request the router forwards (completions, chat, responses) gets a SERVER span, `kvd.router.route`,
from its arrival to the last byte of its answer, a child of the caller's span where it carried W3C
trace context. Each try at a replica is a CLIENT span under it, `kvd.router.forward`, whose context
the router sends on as `traceparent`: the replica's own span (request_spans.py) is that try's
child. A trace then reads client -> router -> each try -> the replica's queue and cache, and a
retry after a 429 shows as its own try, with the status that sent it on.

    kvd.router.route     kvd.tenant, kvd.route_id, kvd.replica, kvd.route_reason, kvd.tried,
                         kvd.prefill, kvd.request_id (the replica's), http.response.status_code
    kvd.router.forward   kvd.replica, kvd.phase (prefill or whole), http.response.status_code

No body is read into a span: no prompt, no output, no token id. A route span's status is an error
where the router answered 5xx (no replica, a replica that failed) or a streamed answer broke off;
a try's where the replica refused it, could not be reached or failed.

Where no endpoint is set, `NO_ROUTE_SPAN` stands in: it records nothing, and the caller's own
`traceparent` goes to the replica as it came.
"""

from __future__ import annotations

from starlette.responses import StreamingResponse

TRACE_HEADERS = ("traceparent", "tracestate")


class NoRouteSpan:
    """A route span that records nothing (tracing off): the forward's code calls it all the same."""

    exemplar = None  # the labels linking the route's figures in /metrics to its trace (RouteSpan's)

    def attempt(self, replica: str, phase: str, headers: dict) -> None:
        pass

    def answered(self, status: int, whole: bool = False) -> None:
        pass

    def attempt_failed(self, why: str) -> None:
        pass

    def chose(self, **attributes) -> None:
        pass

    def broke_off(self, why: str) -> None:
        pass

    def ended_with(self, answer):
        return answer

    def end(self, status: int | None, error: str | None = None) -> None:
        pass


NO_ROUTE_SPAN = NoRouteSpan()


class RouteSpan(NoRouteSpan):
    """One forwarded request's spans: the route's, and its tries' (made by RouteSpans.begin)."""

    def __init__(self, tracer, propagator, path: str, carried: dict, tenant: str | None) -> None:
        from opentelemetry.trace import SpanKind

        self._tracer, self._propagator = tracer, propagator
        parent = propagator.extract(carrier=carried) if carried else None
        attributes = {"http.request.method": "POST", "url.path": path, "kvd.tenant": tenant or "default"}
        if carried.get("x-request-id"):
            attributes["kvd.client_request_id"] = carried["x-request-id"]
        self._span = tracer.start_span("kvd.router.route", context=parent, kind=SpanKind.SERVER,
                                       attributes=attributes)
        self._try = None  # the try at a replica now open
        self._broken: str | None = None  # why a streamed answer broke off
        self._ended = False
        ids = self._span.get_span_context()
        # an exemplar's labels (OpenMetrics): the choice's time in kvd_router_decision_seconds links to this trace
        self.exemplar = {"trace_id": f"{ids.trace_id:032x}", "span_id": f"{ids.span_id:016x}"}

    def attempt(self, replica: str, phase: str, headers: dict) -> None:
        """A try at `replica` begins (`phase` prefill: computing the prompt for a decode replica;
        whole: the request itself): its span, whose context is set in `headers` as traceparent
        (and tracestate) for the replica. A try still open is ended first."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._end_try()
        self._try = self._tracer.start_span(
            "kvd.router.forward", context=set_span_in_context(self._span), kind=SpanKind.CLIENT,
            attributes={"kvd.replica": replica, "kvd.phase": phase})
        for name in TRACE_HEADERS:
            headers.pop(name, None)
        self._propagator.inject(headers, context=set_span_in_context(self._try))

    def answered(self, status: int, whole: bool = False) -> None:
        """The open try's answer began with `status` (`whole`: and is all read). A 4xx or 5xx is
        the try's error; a 429 or 503 ends it as a refusal (the router tries the next replica);
        another answer's try stays open until the answer is whole."""
        from opentelemetry.trace import Status, StatusCode

        if self._try is None:
            return
        self._try.set_attribute("http.response.status_code", status)
        if status >= 400:
            self._try.set_status(Status(StatusCode.ERROR, f"refused: {status}" if status in (429, 503)
                                        else f"answered {status}"))
        if whole or status in (429, 503):
            self._end_try()

    def attempt_failed(self, why: str) -> None:
        """The open try failed (`why`: unreachable, a refusal, a failure mid-answer): ended, an error."""
        from opentelemetry.trace import Status, StatusCode

        if self._try is not None:
            self._try.set_status(Status(StatusCode.ERROR, why))
            self._end_try()

    def chose(self, **attributes) -> None:
        """Attributes of the route (kvd.replica and the like), given by keyword without `kvd.`;
        a None is left out."""
        self._span.set_attributes({f"kvd.{name}": value for name, value in attributes.items() if value is not None})

    def broke_off(self, why: str) -> None:
        """A streamed answer broke off after it began: the try and the route end as errors."""
        self._broken = why
        self.attempt_failed(why)

    def ended_with(self, answer):
        """The route's answer: a non-streamed one ends the span now, a stream when its last byte
        has gone (or the caller left). Returns `answer`, a stream's body wrapped to do so."""
        if not isinstance(answer, StreamingResponse):
            self.end(answer.status_code)
            return answer
        body = answer.body_iterator

        async def until_sent():
            try:
                async for piece in body:
                    yield piece
            finally:
                self.end(answer.status_code)
        answer.body_iterator = until_sent()
        return answer

    def end(self, status: int | None, error: str | None = None) -> None:
        """The route is answered (`status`; None where the caller left first, `error` where the
        router itself failed): its span and any try still open end, once."""
        from opentelemetry.trace import Status, StatusCode

        if self._ended:
            return
        self._ended = True
        if status is not None:
            self._span.set_attribute("http.response.status_code", status)
        why = error or self._broken or (f"answered {status}" if status is not None and status >= 500 else None)
        if why is not None:
            self._span.set_status(Status(StatusCode.ERROR, why))
        self._end_try()
        self._span.end()

    def _end_try(self) -> None:
        if self._try is not None:
            self._try.end()
            self._try = None


class RouteSpans:
    """The router's spans, given to `processor` (otlp_export.span_processor; a test's in-memory one)."""

    def __init__(self, processor) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from kvctl import __version__

        self.provider = TracerProvider(resource=Resource.create({"service.name": "kvd-router",
                                                                 "service.version": __version__}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvd.router")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, path: str, headers, tenant: str | None) -> RouteSpan:
        """A forwarded request arrived (its `headers`, the caller's): its route span, begun."""
        carried = {name: headers[name] for name in (*TRACE_HEADERS, "x-request-id") if headers.get(name)}
        return RouteSpan(self.tracer, self.propagator, path, carried, tenant)

    def shutdown(self) -> None:
        """Send what is batched, then stop (the router's stop)."""
        self.provider.shutdown()
