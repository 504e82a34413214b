"""kvd's log while it serves: a line per finished request (`log_requests`) and a summary of the
engine every `log_stats_interval` seconds (vLLM's "Avg prompt throughput ..." line), both live on
a reload.

A request's line is logfmt (key=value), for the journal's grep and for Loki's or Vector's logfmt
parsers; with `kvd serve --log-format json` its fields are the JSON object's own. It names the
request (the X-KVD-Request-Id of its answer), its tenant, API, model or LoRA adapter and rollout
cohort, how each sample ended, its token counts (prompt, cached, restored from a lower tier,
recomputed after a preemption, output) and its times (queued, first token, whole). Never the
prompt's text, the output's, nor any token id.

The summary is said only where something happened since the last one: tokens in and out per
second, the share of prompt tokens the cache served, requests running and waiting, the device
cache's use, preemptions and rejections. Its counts are totals at the moment it is made, the
tokens of requests still running included, so a long request counts in the interval it ran.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("kvd")
OFF_POLL_S = 10.0  # how often the summary's job looks whether a reload turned it on


def request_fields(request, model: str) -> dict:
    """What the log says of a finished request (engine.requests.Request): counts and times, no text."""
    metrics = request.metrics
    ended = metrics.token_times[-1] if metrics.token_times else None
    reasons = [seq.finish_reason or ("cancelled" if request.cancelled else "unknown") for seq in request.sequences]

    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 4)

    return {"request_id": request.request_id, "tenant": request.tenant,
            "api": request.params.extra.get("api", "internal"), "model": request.adapter or model,
            "finish": "rejected" if request.rejected else ",".join(reasons) or "none",
            **({"rejected": request.rejected_kind} if request.rejected_kind else {}),
            "prompt_tokens": len(request.prompt_ids), "cached_tokens": metrics.cached_tokens,
            "restored_tokens": metrics.restored_tokens, "recomputed_tokens": metrics.recomputed_tokens,
            "output_tokens": sum(len(seq.output_ids) for seq in request.sequences),
            "preemptions": metrics.preemptions, "queued_s": seconds(metrics.time_queued),
            "ttft_s": seconds(metrics.ttft), "e2e_s": seconds(None if ended is None else ended - metrics.arrival),
            **({"cohort": request.cohort} if request.cohort else {}),
            **({"client_request_id": client} if (client := request.params.extra.get("client_request_id")) else {})}


def logfmt(fields: dict) -> str:
    """key=value pairs; a value with a space or a quote is quoted; None is '-'."""
    def one(value) -> str:
        text = "-" if value is None else str(value)
        return '"' + text.replace('"', '\\"') + '"' if (" " in text or '"' in text or not text) else text
    return " ".join(f"{key}={one(value)}" for key, value in fields.items())


class RequestLog:
    """The request lines and the engine summary of one kvd (`service`: an EngineService)."""

    def __init__(self, service, clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.clock = clock
        self.finished_outputs = 0  # output tokens of the requests finished so far (internal ones too)
        self._count = threading.Lock()  # requests finish on the event loop's threads and the engine's
        self.last: dict | None = None  # the totals at the last summary, and when it was made
        service.on_finished(self.observe)

    def observe(self, request) -> None:
        """A request finished (on_finished): count its output; log its line where log_requests is on."""
        outputs = sum(len(seq.output_ids) for seq in request.sequences)
        with self._count:
            self.finished_outputs += outputs
        if request.params.extra.get("api") is not None:  # a pin's warm-up (no api) is nobody's request
            self._say(request)

    def rejected(self, request, kind: str) -> None:
        """A request turned away at admission (engine.AdmissionRejected: never_fits, pinned_out,
        queue_full, tenant_limit), which no sample ran for: its line says which limit (`kind`, which
        the request carries as rejected_kind)."""
        self._say(request)

    def _say(self, request) -> None:
        """The request's line, where log_requests is on."""
        if self.service.config.log_requests:
            fields = request_fields(request, self.service.model_name)
            log.info("request %s", logfmt(fields), extra={"fields": {"event": "request", **fields}})

    def totals(self) -> dict:
        """The engine's running totals now (under the service lock), output tokens of requests in flight included."""
        service = self.service
        engine = service.engine
        with service.lock:
            stats, queue = engine.stats, engine.queue_figures()
            in_flight = sum(len(seq.output_ids) for request in engine.requests.values() for seq in request.sequences)
            counts = engine.cache.state_counts()
            total_blocks = engine.cache.num_blocks
            return {"at": self.clock(), "prompt": stats.prompt_tokens, "hit": stats.hit_tokens,
                    "output": self.finished_outputs + in_flight, "preemptions": stats.preemptions,
                    "rejections": sum(stats.rejections.values()), "running": queue["running"],
                    "waiting": queue["waiting"],
                    "used": (total_blocks - counts["free"] - counts["cached"]) / total_blocks if total_blocks else 0.0,
                    "cached": counts["cached"] / total_blocks if total_blocks else 0.0}

    def summarise(self) -> str | None:
        """The summary since the last one, logged where something happened (returned too); the
        first call only takes the totals. None while the engine is not serving."""
        if self.service.engine is None:
            return None
        now, last = self.totals(), self.last
        self.last = now
        if last is None:
            return None
        elapsed = now["at"] - last["at"]
        delta = {key: now[key] - last[key] for key in ("prompt", "hit", "output", "preemptions", "rejections")}
        if elapsed <= 0 or not (any(delta.values()) or now["running"] or now["waiting"]):
            return None
        fields = {"event": "stats", "seconds": round(elapsed, 1),
                  "prompt_tokens_per_s": round(delta["prompt"] / elapsed, 1),
                  "output_tokens_per_s": round(delta["output"] / elapsed, 1),
                  "prefix_hit_ratio": round(delta["hit"] / delta["prompt"], 4) if delta["prompt"] else None,
                  "running": now["running"], "waiting": now["waiting"],
                  "device_cache_used": round(now["used"], 4), "device_cache_cached": round(now["cached"], 4),
                  "preemptions": delta["preemptions"], "rejections": delta["rejections"]}
        hits = "" if fields["prefix_hit_ratio"] is None else f" ({fields['prefix_hit_ratio']:.1%} from the cache)"
        line = (f"stats, last {elapsed:.0f} s: prompt {fields['prompt_tokens_per_s']:,.1f} tokens/s{hits}, "
                f"output {fields['output_tokens_per_s']:,.1f} tokens/s; {now['running']} running, {now['waiting']} "
                f"waiting; device cache {now['used']:.1%} in use, {now['cached']:.1%} cached; "
                f"{delta['preemptions']} preemptions, {delta['rejections']} rejections")
        log.info("%s", line, extra={"fields": fields})
        return line

    def every(self) -> float:
        """Seconds to the next summary (a housekeeping Job's period): log_stats_interval, or
        OFF_POLL_S while it is 0 (off), so that a reload that turns it on is heard from soon."""
        interval = self.service.config.log_stats_interval
        return interval if interval > 0 else OFF_POLL_S

    def run(self) -> None:
        """The housekeeping job: a summary where log_stats_interval is on (its totals kept either way)."""
        if self.service.config.log_stats_interval > 0:
            self.summarise()
        else:
            self.last = None
