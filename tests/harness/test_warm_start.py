"""The warm starter (``conformance.warm_start``): a process it forks runs as its command would,
with its own environment, output and start-up, and the harness handles it as a child."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from conformance import command, selftest, testees, warm_start
from conformance.case import WireLog
from conformance.ports import free_port
from conformance.suites import proxy_env

#: A module the starter runs: it writes what it sees, then exits with the status it is given.
PROBE = """
    import json, os, sys
    import sitecustomize_ran
    out = {"argv": sys.argv[1:], "var": os.environ.get("PROBE_VAR")}
    out["custom"] = sitecustomize_ran.RAN
    print(json.dumps(out), flush=True)
    if sys.argv[1] == "sleep":
        import time
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def starter() -> warm_start.Starter:
    return warm_start.starter(("json",))


@pytest.fixture
def probe_path(tmp_path: Path) -> Path:
    """A folder with the probe and a ``sitecustomize`` that marks that it ran."""
    (tmp_path / "warm_probe.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "sitecustomize_ran.py").write_text("RAN = False\n")
    (tmp_path / "sitecustomize.py").write_text(
        "import sitecustomize_ran\nsitecustomize_ran.RAN = True\n"
    )
    return tmp_path


def _env(folder: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(folder), "PROBE_VAR": "seen", "PATH": "/usr/bin:/bin"}


def test_a_forked_process_runs_as_its_command(
    starter: warm_start.Starter, probe_path: Path
) -> None:
    log = probe_path / "probe.log"
    log.touch()
    process = starter.start(["warm_probe", "3", "x"], _env(probe_path), log)
    assert process.wait(30.0) == 3  # its exit status, as the starter reports it
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen == {"argv": ["3", "x"], "var": "seen", "custom": True}
    assert process.poll() == 3


def test_a_signal_ends_a_forked_process_as_it_ends_a_child(
    starter: warm_start.Starter, probe_path: Path
) -> None:
    log = probe_path / "probe.log"
    log.touch()
    process = starter.start(["warm_probe", "sleep"], _env(probe_path), log)
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(30.0) == -signal.SIGTERM
    process.kill()  # ended already: nothing to signal


def test_a_starter_whose_modules_fail_to_import_says_so() -> None:
    with pytest.raises(warm_start.WarmStartError, match="did not start"):
        warm_start.Starter(("no_such_module_anywhere",))


def test_reference_nodes_are_forked_unless_warm_start_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forked = testees.start_node("decode")
    try:
        assert isinstance(forked.process, warm_start.ForkedProcess)  # and it answered /health
    finally:
        forked.stop()
    assert forked.process.returncode == 0  # SIGTERM: a clean stop
    monkeypatch.setenv(warm_start.ENV, "0")
    command = testees.start_node("decode")
    try:
        assert not isinstance(command.process, warm_start.ForkedProcess)
    finally:
        command.stop()


def test_a_node_forks_from_a_starter_of_the_modules_its_environment_names() -> None:
    """``PDWIRE_WARM_MODULES`` in a node's environment: the node forks from a starter that has
    imported them beside the node's own modules."""
    assert warm_start.modules_named({warm_start.MODULES_ENV: " wave, ,colorsys "}) == (
        "wave",
        "colorsys",
    )
    assert warm_start.modules_named({}) == ()
    node = testees.start_node("decode", env={warm_start.MODULES_ENV: "wave,colorsys"})
    try:
        assert isinstance(node.process, warm_start.ForkedProcess)
        starter = warm_start.starter((*testees.NODE_MODULES, "wave", "colorsys"))
        stat = Path(f"/proc/{node.process.pid}/stat").read_text()
        assert int(stat.rpartition(")")[2].split()[1]) == starter.pid  # its parent
    finally:
        node.stop()


def test_env_before_a_template_command_joins_its_environment() -> None:
    args = ["env", "A=1", "B=x=y", sys.executable, "-m", "pdwire", "node", "--port", "1"]
    assert command._without_env(args, {"A": "0", "C": "2"}) == (
        [sys.executable, "-m", "pdwire", "node", "--port", "1"],
        {"A": "1", "B": "x=y", "C": "2"},
    )
    assert command._without_env(["pdwire", "proxy"], {"C": "2"}) == (
        ["pdwire", "proxy"],
        {"C": "2"},
    )


@pytest.mark.asyncio
async def test_a_node_template_is_forked_in_a_session_of_its_own(probe_path: Path) -> None:
    """A template that runs the reference node is forked, with the variables its ``env`` sets
    (a ``sitecustomize`` on the ``PYTHONPATH`` it names runs); SIGTERM to its process group
    stops it and its worker. The reference proxy's template is forked too; any other template
    runs as a command."""
    (probe_path / "sitecustomize.py").write_text(
        f"open({str(probe_path / 'ran')!r}, 'w').close()\n"
    )
    port = free_port()
    template = command.with_env(
        selftest.reference_d_command().replace("{port}", str(port)),
        {"PYTHONPATH": str(probe_path)},
    )
    node = command.TemplateProcess(
        "D", command.fill(template, {"python": sys.executable}, "D"), dict(os.environ), WireLog()
    )
    await node.spawn()
    try:
        assert isinstance(node.process, warm_start.ForkedProcess)
        await node.wait_listening(f"http://127.0.0.1:{port}", 60.0)
        assert (probe_path / "ran").exists()
        group = node.process.pid
        assert os.getpgid(group) == group  # a session, and so a process group, of its own
    finally:
        await node.stop()
    assert node.returncode == 0  # its SIGTERM: a clean stop
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)  # no process of the group is left

    port = free_port()
    values = {"python": sys.executable, "port": str(port), "decode_url": "http://127.0.0.1:9"}
    values |= {"prefill_url": "http://127.0.0.1:9", "bootstrap_url": "http://127.0.0.1:9"}
    template = command.fill(proxy_env.REFERENCE_COMMAND, values, "proxy")
    proxy = command.TemplateProcess("proxy", template, dict(os.environ), WireLog())
    await proxy.spawn()
    try:
        assert isinstance(proxy.process, warm_start.ForkedProcess)
        await proxy.wait_listening(f"http://127.0.0.1:{port}", 60.0)
    finally:
        await proxy.stop()
    assert proxy.returncode == 0

    other = command.TemplateProcess(
        "C", [sys.executable, "-c", "pass"], dict(os.environ), WireLog()
    )
    await other.spawn()
    try:
        assert isinstance(other.process, asyncio.subprocess.Process)
    finally:
        await other.stop()
