"""Where kvd's and kvd router's spans go: OpenTelemetry's OTLP exporter, batched off the serving
thread, over the protocol OpenTelemetry's own variables name.

    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or OTEL_EXPORTER_OTLP_PROTOCOL): http/protobuf (the
    default, OpenTelemetry's own: http://collector:4318/v1/traces) or grpc (http://collector:4317;
    an https:// endpoint is sent over TLS, an http:// one in clear text).

The endpoint is the setting `otlp_traces_endpoint` (vLLM's `--otlp-traces-endpoint`). The
exporters' other variables (OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_CERTIFICATE,
OTEL_SERVICE_NAME, ...) apply as OpenTelemetry documents them. The packages are the `otel` extra.
"""

from __future__ import annotations

import os
from typing import Mapping

PROTOCOLS = ("http/protobuf", "grpc")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")  # the first set wins
OTEL_MISSING = "otlp_traces_endpoint: traces need OpenTelemetry's packages: pip install 'kvctl[otel]'"
ENDPOINT_EXPECTED = ("must be an http:// or https:// URL (OTLP over HTTP, e.g. http://collector:4318/v1/traces; "
                     "over gRPC, with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc, e.g. http://collector:4317)")


def check_endpoint(value) -> None:
    """A setting's check (config.py, router_config.py): ValueError unless an http(s) URL."""
    if value is not None and not str(value).startswith(("http://", "https://")):
        raise ValueError(ENDPOINT_EXPECTED)


def traces_protocol(env: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol the environment names (http/protobuf where none); ValueError naming the
    variable and its value where it names one the exporters do not speak."""
    env = os.environ if env is None else env
    for name in PROTOCOL_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            if value not in PROTOCOLS:
                raise ValueError(f"{name}: invalid value {value!r}: must be one of {', '.join(PROTOCOLS)} "
                                 "(http/json is not sent by OpenTelemetry's Python exporters)")
            return value
    return "http/protobuf"


def span_processor(endpoint: str | None, env: Mapping[str, str] | None = None):
    """The batched OTLP exporter for `endpoint` (None when it is unset), over traces_protocol(env).
    RuntimeError naming the setting when OpenTelemetry's packages are not installed; ValueError for
    a protocol variable's bad value."""
    if endpoint is None:
        return None
    protocol = traces_protocol(env)
    try:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://")))
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise RuntimeError(OTEL_MISSING) from None
    return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
