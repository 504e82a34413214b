"""examples/kvd@.service, one kvd per GPU: what it shares with kvd.service, and where an
instance answers, against what kvd router and the calibration timer look for.

(The kvctl and kvd commands in every unit are parsed in test_cli.py.)
"""

from __future__ import annotations

from pathlib import Path

from kvctl.daemon.default_paths import default_socket, default_state_dir

EXAMPLES = Path(__file__).parent.parent / "examples"
# the template's lines that differ from kvd.service's, and those only it has
PER_INSTANCE = {
    "Description=kvd KV cache daemon": "Description=kvd KV cache daemon on GPU %i",
    "StateDirectory=kvd": "StateDirectory=kvd-%i",
    "RuntimeDirectory=kvd": "RuntimeDirectory=kvd-%i",
    "DeviceAllow=/dev/nvidia0 rw": "DeviceAllow=/dev/nvidia%i rw",
    "Environment=TRITON_CACHE_DIR=/var/lib/kvd/triton": "Environment=TRITON_CACHE_DIR=/var/lib/kvd-%i/triton",
}
ONLY_IN_TEMPLATE = ["Environment=CUDA_VISIBLE_DEVICES=%i", "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID",
                    "EnvironmentFile=-/etc/kvd/kvd-%i.env"]


def unit_lines(name: str) -> list[str]:
    """A unit file's settings and section headers, in order, without comments or blank lines."""
    return [line.strip() for line in (EXAMPLES / name).read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def setting(lines: list[str], key: str, instance: str) -> str:
    [value] = [line.split("=", 1)[1] for line in lines if line.startswith(key + "=")]
    return value.replace("%i", instance)


def test_the_per_gpu_template_is_kvd_service_but_for_the_instance_lines():
    """A hardening line added to kvd.service and not to kvd@.service (or the other way) fails here."""
    plain, template = unit_lines("kvd.service"), unit_lines("kvd@.service")
    expected = [PER_INSTANCE.get(line, line) for line in plain]
    at = expected.index(PER_INSTANCE["Environment=TRITON_CACHE_DIR=/var/lib/kvd/triton"]) + 1
    assert template == expected[:at] + ONLY_IN_TEMPLATE + expected[at:]
    assert set(PER_INSTANCE) <= set(plain)  # each line this test replaces is still in kvd.service


def test_kvd_on_gpu_n_answers_where_the_router_and_its_calibration_look(monkeypatch):
    """kvd@N's socket (kvd's default under systemd's RuntimeDirectory) is the router's Nth
    replica and its calibration's KVD_SOCKET; its state is its own; it sees GPU N alone."""
    kvd, calibrate = unit_lines("kvd@.service"), unit_lines("kvd-calibrate@.service")
    replicas = unit_lines("router-replicas")
    router_after = setting(unit_lines("kvd-router.service"), "After", "").split()
    for n, replica in enumerate(replicas):
        gpu = str(n)
        monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/" + setting(kvd, "RuntimeDirectory", gpu))
        monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/" + setting(kvd, "StateDirectory", gpu))
        assert default_socket() == replica == f"/run/kvd-{n}/kvd.sock"
        assert setting(calibrate, "Environment", gpu) == f"KVD_SOCKET={replica}"
        assert default_state_dir() == f"/var/lib/kvd-{n}"
        assert f"kvd@{n}.service" in router_after
        environment = [line.split("=", 1)[1].replace("%i", gpu) for line in kvd if line.startswith("Environment=")]
        assert f"CUDA_VISIBLE_DEVICES={n}" in environment and f"TRITON_CACHE_DIR=/var/lib/kvd-{n}/triton" in environment
        assert f"DeviceAllow=/dev/nvidia{n} rw" in [line.replace("%i", gpu) for line in kvd]
    assert len(replicas) == 2
    assert setting(calibrate, "Requires", "3") == setting(calibrate, "After", "3") == "kvd@3.service"
    timer = unit_lines("kvd-calibrate@.timer")
    assert unit_lines("kvd-calibrate.timer")[2:] == timer[2:]  # the same schedule as the single kvd's


def test_each_kvd_on_a_host_listens_on_a_port_of_its_own_and_prometheus_scrapes_them():
    """kvd.yaml's one `listen` would bind every kvd@N to the same port (the second fails to start):
    kvd-N.env gives each its own, kvd router keeps its own, and prometheus.yml scrapes those."""
    import yaml

    from kvctl.daemon.config import kvd_env_typos, resolve
    from kvctl.daemon.router_config import resolve_router

    env = dict(line.split("=", 1) for line in unit_lines("kvd-0.env"))
    assert kvd_env_typos(env) == []  # every variable is a kvd serve setting
    ports = []
    for n in (0, 1):  # kvd-1.env is kvd-0.env with each port one up, as kvd-0.env says
        mine = {name: value.replace("8100", str(8100 + n)) for name, value in env.items()}
        config = resolve({}, mine, EXAMPLES / "kvd.yaml")
        assert config.token_file == "/etc/kvd/tokens"  # TCP's tokens, from the shared file
        ports.append(int(config.listen.rsplit(":", 1)[1]))
    router = int(resolve_router({}, {}, EXAMPLES / "kvd-router.yaml").listen.rsplit(":", 1)[1])
    assert ports == [8100, 8101] and router not in ports
    jobs = {job["job_name"]: job for job in yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())["scrape_configs"]}
    scraped = {name: [int(t.rsplit(":", 1)[1]) for c in job["static_configs"] for t in c["targets"]]
               for name, job in jobs.items()}
    assert scraped == {"kvd": ports, "kvd-router": [router]}
    assert all(job["authorization"]["credentials_file"] for job in jobs.values())
