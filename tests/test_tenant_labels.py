"""Per-tenant metrics name a bounded number of tenants: the first seen keep their label, the rest
are summed under tenant="*", and a tenant's label never changes (so folded counters only grow)."""

from __future__ import annotations

import re

import pytest

from kvctl.daemon.server.tenant_labels import OTHERS, TenantLabels


def test_the_first_tenants_seen_keep_their_label_and_the_rest_are_summed_under_star():
    labels = TenantLabels(2)
    assert [labels(t) for t in ("b", "a", "c", "b", "d", "a")] == ["b", "a", OTHERS, "b", OTHERS, "a"]
    assert labels.fold([("c", 5), ("a", 1), ("d", 2), ("b", 3)]) == [("*", 7), ("a", 1), ("b", 3)]
    fresh = TenantLabels(1)  # fold takes tenants in name order, whatever order they come in
    assert fresh.fold([("zeta", 1), ("alpha", 2)]) == [("*", 1), ("alpha", 2)]
    assert TenantLabels(0).fold([("a", 1), ("b", 2)]) == [("*", 3)]
    with pytest.raises(ValueError, match="max_tenant_metric_series: must be >= 0, got -1"):
        TenantLabels(-1)


def test_kvd_s_per_tenant_series_stop_at_the_limit_and_kvctl_tenants_still_lists_everyone(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, settled, start_service

    service = start_service(tmp_path, max_tenant_metric_series=1)
    try:
        app = create_app(service, service.metrics, front="unix")
        prompts = {"acme": list(range(1, 40)), "globex": list(range(1, 30)), "initech": list(range(1, 21))}
        for tenant, prompt in prompts.items():
            response = call(app, "POST", "/v1/completions", headers={"X-KVD-Tenant": tenant},
                            json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert response.status_code == 200, response.text
        # the last request's client has its answer just before kvd's metrics take the request
        text = settled(lambda: call(app, "GET", "/metrics").text,
                       lambda text: 'kvd_tenant_ttft_seconds_count{tenant="*"} 2.0' in text)
        series = dict(re.findall(r'^kvd_tenant_prompt_tokens_total\{tenant="([^"]+)"\} (\S+)$', text, re.MULTILINE))
        assert series == {"acme": "39.0", "*": "49.0"}  # globex's 29 and initech's 20 under "*"
        assert 'kvd_tenant_ttft_seconds_count{tenant="*"} 2.0' in text
        assert 'tenant="globex"' not in text and 'tenant="initech"' not in text
        rows = call(app, "GET", "/admin/tenants").json()["tenants"]
        assert [row["tenant"] for row in rows] == ["acme", "globex", "initech"]
    finally:
        service.shutdown(1)


def test_a_negative_limit_is_refused_naming_the_setting():
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as raised:
        resolve({}, env={"KVD_MAX_TENANT_METRIC_SERIES": "-5"})
    assert str(raised.value) == "max_tenant_metric_series: invalid value '-5' from KVD_MAX_TENANT_METRIC_SERIES: must be >= 0"
