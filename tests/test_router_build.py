"""What kvd router runs: `software` in its /admin/status, kvd_router_build_info, and kvctl status's
line where its kvd is not its replicas'."""

from __future__ import annotations

import platform

import pytest

pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from kvctl import __version__  # noqa: E402
from kvctl.fleet_status import render_fleet_status  # noqa: E402

from .test_router import drive, replicas, router_app  # noqa: E402,F401


def test_the_router_says_what_it_runs_and_kvctl_names_replicas_on_another_kvd(replicas):  # noqa: F811
    _, app = router_app(replicas, "round_robin")
    status, metrics = drive(app, [lambda c: c.get("/admin/status"), lambda c: c.get("/metrics")])
    body = status.json()
    assert body["software"] == {"kvd": __version__, "python": platform.python_version()}
    line = f'kvd_router_build_info{{python="{platform.python_version()}",version="{__version__}"}} 1.0'
    assert line in metrics.text.splitlines()

    def shown(fleet: dict) -> str:
        console = Console(record=True, width=200)
        render_fleet_status(fleet, console)
        return " ".join(console.export_text().split())

    assert "kvd router runs" not in shown(body)  # one kvd throughout
    body["replica_status"][1]["software"]["kvd"] = "9.9.0"
    assert (f"kvd router runs kvd {__version__}, its replicas 9.9.0 on replica-1 (a router of another version may "
            "not read what they answer: upgrade it with them)") in shown(body)
    del body["software"]  # an older router does not say
    assert "kvd router runs" not in shown(body)
