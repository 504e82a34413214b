"""Prometheus metrics for `kvd router` (`GET /metrics`), read from the router's books at scrape time.

    kvd_router_requests_total{replica}            requests sent to each replica
    kvd_router_prompt_tokens_total{replica}       their prompt tokens, as the router counted them
    kvd_router_cached_tokens_total{replica}       of those, what the router counted as held there
                                                  when it chose it (the ratio is the fleet's expected reuse)
    kvd_router_questions_total{replica,result}    route-facts asked on a request's path (ok, failed):
                                                  every request with --view ask; with events, only
                                                  while a replica's view is not current
    kvd_router_forward_failures_total{replica}    requests the replica failed after it may have started them (502,
                                                  or an error event ending a streamed answer it broke off)
    kvd_router_rerouted_total{replica}            requests it refused before starting them (429, 503),
                                                  could not be reached for, or closed the connection of
                                                  before any answer (once a request): sent to the next best
    kvd_router_passed_over_total{replica}         requests sent elsewhere because its predicted wait was past its
                                                  max_queue_wait (queue_limits: heed)
    kvd_router_timeouts_not_rerouted_total        requests a replica turned away after their wait (queue_timeout)
                                                  that went to no other: none was predicted to start them in time
    kvd_router_unrouted_total                     requests no replica took in: none could take them or be
                                                  reached, or each one asked was stopping (503)
    kvd_router_disaggregated_total{outcome}       requests by how their prefill went (0 without prefill replicas):
                                                  transferred (a prefill replica computed the prompt and wrote it to
                                                  Redis), local (the replica that decodes it holds all but
                                                  local_prefill_tokens of it, or it scores its prompt), prefill_failed
                                                  or no_prefill_replica (the decode replica computed the whole prompt)
    kvd_router_open_requests{replica}             forwarded requests still answering
    kvd_router_replica_draining{replica}          1 while it takes no new request (drained, or leaving the fleet)
    kvd_router_view_synced{replica}               events view: 1 while its feed is followed
    kvd_router_view_load_age_seconds{replica}     events view: age of its latest load answer
    kvd_router_view_pending_keys{replica}         events view: blocks sent there, not yet in its feed
    kvd_router_view_snapshots_total{replica}      events view: feeds started from a snapshot (1 + restarts,
                                                  gaps and lost connections)
    kvd_router_reply_ids_kept                     events view: chat replies whose ids it keeps, to weigh a next turn
                                                  as the replica prompts it (router_replies.py)
    kvd_router_reply_ids_kept_bytes               events view: what they take, within reply_ids_bytes
    kvd_router_reply_ids_dropped_total            events view: replies it let go of for room
    kvd_router_decision_seconds                   histogram: time to choose a replica (OpenMetrics scrapes:
                                                  exemplars naming the route's span, where spans are sent)
    kvd_router_fleet_rollout_actions_total{action}  fleet rollouts its watch acted on (fleet_rollouts.py):
                                                  rollback_after_replica (one replica rolled it back, the router
                                                  the rest), rollback_judged (tripped on the fleet's figures,
                                                  judged: fleet), join (started at a replica that joined since)
    kvd_router_fleet_rollout_watch_failures_total its checks that failed (the log says why; the next tries again)
    kvd_router_build_info{version,python}         1, labelled with the router's kvd and Python versions
    kvd_gc_pause_seconds{generation}              histogram: how long each of Python's garbage collections
                                                  stopped the router (kvd router; gc_pauses.py)
    kvd_gc_frozen_objects                         objects frozen out of the collector's walks (gc_freeze)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvctl.daemon.software import router_versions

from .cut_connections import CutConnections
from .fleet_rollouts import WATCH_ACTIONS
from .gc_pauses import metric_families as gc_metric_families
from .router_service import PD_OUTCOMES

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _RouterCollector:
    def __init__(self, service) -> None:
        self.service = service

    def collect(self):
        replicas = self.service.replicas
        now = self.service.clock()

        def per_replica(family, kind, description, value):
            metric = family(f"kvd_router_{kind}", description, labels=["replica"])
            for r in replicas:
                got = value(r)
                if got is not None:
                    metric.add_metric([r.name], got)
            return metric

        yield per_replica(CounterMetricFamily, "requests", "Requests sent to each replica", lambda r: r.sent)
        yield per_replica(CounterMetricFamily, "prompt_tokens", "Prompt tokens of the requests sent",
                          lambda r: r.prompt_tokens)
        yield per_replica(CounterMetricFamily, "cached_tokens", "Prompt tokens the router counted as held by the "
                          "replica it chose", lambda r: r.cached_tokens)
        questions = CounterMetricFamily("kvd_router_questions", "Route-facts questions asked on a request's path "
                                        "(ok, failed), or not asked as the replica rested after failed ones "
                                        "(skipped)", labels=["replica", "result"])
        for r in replicas:
            questions.add_metric([r.name, "ok"], r.questions - r.failed_questions)
            questions.add_metric([r.name, "failed"], r.failed_questions)
            questions.add_metric([r.name, "skipped"], r.skipped_questions)
        yield questions
        yield per_replica(GaugeMetricFamily, "replica_resting", "1 while requests pass the replica over unasked: it "
                          "answered none of its latest questions (or connections), nor a load poll since",
                          lambda r: float(self.service.resting(r, now)))
        yield per_replica(GaugeMetricFamily, "replica_failing", "1 while requests pass the replica over as its "
                          "latest answers were failures of its own (500s: its engine failing, say)",
                          lambda r: float(self.service.failing(r, now)))
        yield per_replica(CounterMetricFamily, "forward_failures", "Requests the replica failed after it may have "
                          "started them", lambda r: r.failed_forwards)
        after = self.service.silent_give_up_seconds
        yield per_replica(CounterMetricFamily, "given_up", "Requests the router stopped waiting for as the replica "
                          f"had answered nothing for {after:g} s{'' if after else ' (0: never)'} (each a 504, or a "
                          "stream's error event); counted in forward_failures too", lambda r: r.given_up)
        yield per_replica(CounterMetricFamily, "rerouted", "Requests the replica refused before starting them, "
                          "could not be reached for, or closed the connection of before answering, sent to the "
                          "next best replica", lambda r: r.rerouted)
        yield per_replica(CounterMetricFamily, "passed_over", "Requests sent elsewhere because the replica's "
                          "predicted wait was past its max_queue_wait", lambda r: r.passed_over)
        yield CounterMetricFamily("kvd_router_timeouts_not_rerouted", "Requests a replica turned away after their "
                                  "wait (queue_timeout) that no other replica was predicted to start in time: the "
                                  "caller got that 503", value=self.service.timeouts_not_rerouted)
        yield from gc_metric_families(self.service.gc_pauses)
        book = self.service.rollout_watch
        actions = CounterMetricFamily("kvd_router_fleet_rollout_actions", "Fleet rollouts the router's watch acted "
                                      "on: rolled back at the other replicas after one rolled it back "
                                      "(rollback_after_replica), rolled back on the fleet's figures "
                                      "(rollback_judged), started at a replica that joined since (join)",
                                      labels=["action"])
        for name in WATCH_ACTIONS:
            actions.add_metric([name], book.actions[name])
        yield actions
        yield CounterMetricFamily("kvd_router_fleet_rollout_watch_failures", "Checks of the router's fleet rollout "
                                  "watch that failed (its log says why; the next one tries again)",
                                  value=book.failures)
        software = router_versions()
        build = GaugeMetricFamily("kvd_router_build_info", "1, labelled with the kvd and Python versions the router "
                                  "runs", labels=["version", "python"])
        build.add_metric([software["kvd"], software["python"]], 1)
        yield build
        yield CounterMetricFamily("kvd_router_unrouted", "Requests the router gave up on with no replica taking "
                                  "them in: none could take them or be reached, or each one asked was stopping (503)",
                                  value=self.service.unrouted)
        outcomes = CounterMetricFamily("kvd_router_disaggregated", "Requests by how their disaggregated prefill "
                                       "went (zero without --prefill replicas): transferred (a prefill replica "
                                       "computed the prompt into Redis), local (little to compute where it decoded), "
                                       "prefill_failed or no_prefill_replica (the decode replica computed it all)",
                                       labels=["outcome"])
        for outcome in PD_OUTCOMES:
            outcomes.add_metric([outcome], self.service.pd_outcomes[outcome])
        yield outcomes
        yield per_replica(GaugeMetricFamily, "open_requests", "Forwarded requests still answering", lambda r: r.open)
        yield per_replica(GaugeMetricFamily, "replica_draining", "1 while the replica takes no new request (drained, "
                          "or leaving the fleet)", lambda r: float(r.draining))
        if self.service.view != "events":
            return
        yield per_replica(GaugeMetricFamily, "view_synced", "1 while the replica's event feed is followed",
                          lambda r: float(r.view.synced))
        yield per_replica(GaugeMetricFamily, "view_load_age_seconds", "Age of the replica's latest load answer",
                          lambda r: r.view.load_age(now))
        yield per_replica(GaugeMetricFamily, "view_pending_keys", "Blocks sent to the replica, not yet in its feed",
                          lambda r: r.view.pending_count(now))
        yield per_replica(CounterMetricFamily, "view_snapshots", "Feeds started from a snapshot",
                          lambda r: r.snapshots)
        if self.service.splices_replies:
            replies = self.service.reply_ids.figures()
            yield GaugeMetricFamily("kvd_router_reply_ids_kept", "Chat replies whose ids the router keeps, to weigh "
                                    "a next turn as the replica prompts it", value=replies["replies"])
            yield GaugeMetricFamily("kvd_router_reply_ids_kept_bytes", "What the kept replies' ids take, within "
                                    "reply_ids_bytes", value=replies["bytes"])
            yield CounterMetricFamily("kvd_router_reply_ids_dropped", "Replies' ids the router let go of for room",
                                      value=replies["dropped"])
        if self.service.tls is not None:
            yield GaugeMetricFamily("kvd_router_tls_certificate_expiry_timestamp_seconds", "When the certificate "
                                    "the TCP front serves expires (Unix time): alert well before it",
                                    value=self.service.tls.certificate.not_after)


class RouterMetrics:
    """One registry per router: its books read at scrape time, and the decision-time histogram."""

    def __init__(self, service) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_RouterCollector(service))
        self.registry.register(CutConnections("kvd_router_http_cut_connections"))
        self.decision = Histogram("kvd_router_decision_seconds", "Time to choose a replica for a request",
                                  buckets=DECISION_BUCKETS, registry=self.registry)
        service.on_decision = self.decision.observe
