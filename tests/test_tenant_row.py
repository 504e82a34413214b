"""One tenant's row of GET /admin/tenants (`?tenant=T`): `kvctl tenants --tenant T` and
`kvctl hit-curve --tenant T` ask kvd for it alone, and kvd makes no other row and no other
tenant's hit-curve figures."""

from __future__ import annotations

import json

import pytest

from kvctl.daemon.server.app import create_app

from .daemon_fixtures import call, start_service
from .test_hit_curve_service import a_b_c_a, without_spans


def test_one_tenant_s_row_is_the_whole_answer_s_and_only_its_figures_are_made(tmp_path, monkeypatch):
    from kvctl.daemon.cache.hit_curve import HitCurve

    service = start_service(tmp_path, num_blocks=64, tenant_cache_shares="acme=0.5,*=0.5")
    try:
        app = create_app(service, service.metrics, front="unix")
        a_b_c_a(app, tenants=("acme", "globex", "globex", "acme"))
        whole = call(app, "GET", "/admin/tenants").json()
        assert [row["tenant"] for row in whole["tenants"]] == ["acme", "globex"] and whole["listed"] == 2
        made, figures = [], HitCurve.row_figures

        def counted(curve, row, block_size, sizes=False):
            made.append(block_size)
            return figures(curve, row, block_size, sizes)

        monkeypatch.setattr(HitCurve, "row_figures", counted)
        body = call(app, "GET", "/admin/tenants", params={"tenant": "globex"}).json()
        assert body["tenants"] == [whole["tenants"][1]] and body["listed"] == 2
        assert len(made) == 2  # globex's row and the retired sum (acme, followed alone, is not asked for)
        assert body["hit_curve"]["retired"] == whole["hit_curve"]["retired"]
        made.clear()
        body = call(app, "GET", "/admin/tenants", params={"tenant": "acme"}).json()
        row, before = body["tenants"][0], whole["tenants"][0]
        assert {**row, "hit_curve": None} == {**before, "hit_curve": None} and row["hit_curve"]["alone"]["prompts"] == 2
        assert without_spans(row["hit_curve"]["alone"]) == without_spans(before["hit_curve"]["alone"])
        assert len(made) == 5  # its row, the retired sum and its curve alone (since followed, and two windows)
        body = call(app, "GET", "/admin/tenants", params={"tenant": "initech"}).json()
        assert body["tenants"] == [] and body["listed"] == 2 and body["blocks"] == 64
        answer = call(app, "GET", "/admin/tenants", params={"tenant": "a b"})
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "tenant" and "'a b'" in answer.json()["error"]["message"]
    finally:
        service.shutdown(deadline=2)


def test_kvctl_tenants_draws_one_tenant_s_row_and_says_when_kvd_lists_none(tmp_path, capsys):
    from .test_cli import cli
    from .test_health_checks import served_on

    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        a_b_c_a(app, tenants=("acme", "globex", "globex", "acme"))
        with served_on(app, str(tmp_path / "served.sock")) as path:
            status, out, err = cli(capsys, "--socket", path, "tenants", "--tenant", "globex")
            assert status == 0, err
            rows = [" ".join(line.split()) for line in out.splitlines()]
            assert any(row.startswith("globex 142 0.0% ") for row in rows), out
            assert not any(row.startswith("acme") for row in rows)
            status, out, err = cli(capsys, "--socket", path, "tenants", "--tenant", "acme", "--json")
            assert status == 0, err
            answer = json.loads(out)
            assert [row["tenant"] for row in answer["tenants"]] == ["acme"] and answer["listed"] == 2
            assert (answer["tenants"][0]["prompt_tokens"], answer["tenants"][0]["hit_tokens"]) == (142, 64)
            status, _, err = cli(capsys, "--socket", path, "tenants", "--tenant", "initech")
            assert status != 0
            assert ("tenant: kvd lists no 'initech' among its 2 tenants (those active most recently, and those "
                    "holding blocks, pins or requests: kvctl tenants)") in " ".join(err.split())
            status, _, err = cli(capsys, "--socket", path, "tenants", "--tenant", "acme", "--top", "3")
            assert status != 0 and "give --tenant or --top, not both" in err
    finally:
        service.shutdown(deadline=2)


def test_kvd_router_asks_each_replica_for_the_one_tenant():
    from kvctl.daemon.server.fleet_admin import merge_tenant_lists
    from kvctl.errors import UserError
    from kvctl.tenant_row import listed_row

    status, body = merge_tenant_lists(["r0", "r1"], [
        (200, {"tenants": [], "listed": 3, "blocks": 64}),
        (200, {"tenants": [], "listed": 5, "blocks": 64})])
    assert status == 200 and body["tenants"] == [] and "listed" not in body  # (tenants at two replicas are one)
    with pytest.raises(UserError) as refused:
        listed_row(body, "initech", "kvctl tenants")
    assert str(refused.value) == ("tenant: kvd lists no 'initech' (those active most recently, and those holding "
                                  "blocks, pins or requests: kvctl tenants)")
    # a kvd of before ?tenant= answers every row: the one asked for is found among them
    older = {"tenants": [{"tenant": "acme", "prompt_tokens": 1}, {"tenant": "globex", "prompt_tokens": 2}]}
    assert listed_row(older, "globex", "kvctl tenants") == {"tenant": "globex", "prompt_tokens": 2}
