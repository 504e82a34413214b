"""Layering: kernels and policies import nothing of the project; no torch at kvctl start-up;
the four packages load from this repository; no asyncio.wait_for in them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, relative level) of every import statement in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
    return found


@pytest.mark.parametrize("package", ["kernels", "policies"])
def test_leaf_packages_import_nothing_of_the_project(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files
    for path in files:
        for module, level in _imports(path):
            where = f"{path.relative_to(REPO)} imports {'.' * level}{module}"
            assert not (module == "kvctl" or module.startswith("kvctl.")), where
            assert module.split(".")[0] not in {"daemon", "kernels", "policies"} or level, where
            # a relative import may only stay inside the package itself
            if level:
                assert level == 1 and path.parent == REPO / package, where


def test_daemon_never_imports_the_cli():
    for path in sorted((REPO / "daemon").rglob("*.py")):
        for module, level in _imports(path):
            assert not module.startswith("kvctl.cli") and not module.startswith("kvctl.bench"), path


def test_no_package_waits_with_asyncio_wait_for():
    """CPython 3.11's asyncio.wait_for returns what it waited for, and swallows the cancellation,
    when the task is cancelled in the same turn as that thing finishes (gh-86296; 3.12 rewrote
    it). A router follower went on following after its stop that way, and a cancelled request's
    handler went on serving: `async with asyncio.timeout(...)` passes the cancellation on."""
    used = []
    for package in ("daemon", "kvctl", "kernels", "policies"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if (isinstance(node, ast.Attribute) and node.attr == "wait_for"
                        and isinstance(node.value, ast.Name) and node.value.id == "asyncio"):
                    used.append(f"{path.relative_to(REPO)}:{node.lineno}")
                elif isinstance(node, ast.ImportFrom) and node.module == "asyncio" and any(
                        alias.name == "wait_for" for alias in node.names):
                    used.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert used == []


_LOADED = """
import json, sys
from kvctl.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def loaded_by(args: list[str], **run) -> set[str]:
    """The modules a fresh interpreter has loaded once `kvctl ARGS` has run."""
    done = subprocess.run([sys.executable, "-c", _LOADED, *args], capture_output=True, text=True, cwd=REPO,
                          check=True, **run)
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("args", [["--help"], ["bench", "replay", "--demo-requests", "20",
                                               "--block-sizes", "64", "--json"]])
def test_kvctl_start_up_never_imports_torch(args):
    loaded = loaded_by(args)
    flags = {name: name in loaded for name in ("torch", "triton")}
    assert flags == {"torch": False, "triton": False}


# what a command that only talks to kvd (or prints a version) never needs: the replay stack and the
# cache core (`kvctl bench replay`), markdown-it (`kvctl adr show`), asyncio (`kvctl bench serve`),
# yaml (`kvctl rollout start`), the SQLite store; each loaded by its own command when it runs
_NOT_AT_START = ("kvctl.daemon.replay.simulator", "kvctl.daemon.replay.fleet", "kvctl.daemon.cache.manager",
                 "kvctl.trace_stats", "kvctl.replay_report", "rich.markdown", "asyncio", "yaml", "sqlite3",
                 "torch", "numpy")


@pytest.mark.parametrize("args", [["--version"], ["--socket", "/nonexistent/kvd.sock", "status"],
                                  ["--socket", "/nonexistent/kvd.sock", "tenants"]])
def test_kvctl_start_up_loads_only_what_the_command_needs(args, tmp_path):
    loaded = loaded_by(args, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert "typer" in loaded
    assert sorted(loaded & set(_NOT_AT_START)) == []


def test_the_four_packages_load_from_this_repository():
    import kvctl
    import kvctl.daemon
    import kvctl.kernels
    import kvctl.policies

    for module, folder in ((kvctl, "kvctl"), (kvctl.daemon, "daemon"), (kvctl.kernels, "kernels"),
                           (kvctl.policies, "policies")):
        assert Path(module.__file__).resolve() == REPO / folder / "__init__.py", module.__name__


@pytest.mark.parametrize("name", ["daemon", "kernels", "policies"])
def test_the_checkout_s_folders_shadow_no_published_package(name):
    """The folders import only as kvctl.*: as bare `kernels` they would stand in for the published
    `kernels` package that transformers imports, and break every test that builds a transformers model."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    assert origin is None or REPO / name not in origin.parents, f"{name} resolves to {origin}"
    if name == "kernels" and spec is not None:  # transformers >= 5.25 depends on the published one
        from importlib.metadata import version

        assert version("kernels")


def test_console_scripts_run(tmp_path):
    bindir = Path(sys.executable).parent
    done = subprocess.run([str(bindir / "kvd"), "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "kvd 0.1.0"
    done = subprocess.run([str(bindir / "kvd"), "--help"], capture_output=True, text=True, check=True)
    assert "kvd hosts a model over a paged KV cache" in done.stdout
    done = subprocess.run([str(bindir / "kvctl"), "bench", "replay", "--demo-requests", "30",
                           "--block-sizes", "32", "--policy", "cost", "--json"],
                          capture_output=True, text=True, check=True)
    doc = json.loads(done.stdout)
    assert doc["requests"] == 30 and doc["runs"][0]["policy"] == "cost"


def test_kvd_router_s_modules_never_import_torch():
    """kvd router weighs prompts with the tokenizer and chat template alone: torch (and triton)
    would add seconds to its start and a large heap to every collection."""
    probe = ("import json, sys\n"
             "import kvctl.daemon.config, kvctl.daemon.router_config, kvctl.daemon.server.router\n"
             "import kvctl.daemon.server.router_service, kvctl.daemon.server.route_question\n"
             "print(json.dumps({'torch': 'torch' in sys.modules, 'triton': 'triton' in sys.modules}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch": False, "triton": False}
