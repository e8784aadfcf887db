"""``pdwire decode --pcap`` on a capture this test takes with tcpdump (Debian's package, which
``make test`` installs) on loopback, of a real ``pdwire run``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pdwire import cli
from reference_connector import cli_run, run
from reference_connector.kv_content import KVShape

pytest.importorskip("mooncake.engine")
TCPDUMP = shutil.which("tcpdump")
pytestmark = pytest.mark.skipif(TCPDUMP is None, reason="tcpdump is not installed (make sysdeps)")

RUN = [
    *("--layers", "4", "--kv-heads", "8", "--head-dim", "16", "--block-size", "4"),
    *("--requests", "3", "--concurrency", "1", "--prompt-tokens", "64", "--max-tokens", "4"),
    *("--raw-repeats", "1", "--timeout", "60", "--decode-tp", "2"),
]
SHAPE = KVShape(num_layers=4, num_kv_heads=8, head_dim=16, block_size=4)


def _capture(path: Path, run_json: Path) -> None:
    """tcpdump on lo around a ``pdwire run``; stopped as a user stops it, with SIGINT."""
    assert TCPDUMP is not None
    command = [TCPDUMP, "-i", "lo", "-U", "-s", "0", "-w", str(path), "tcp"]
    with subprocess.Popen(command, stderr=subprocess.PIPE) as dump:
        try:
            assert dump.stderr is not None
            assert b"listening on lo" in dump.stderr.readline()
            assert cli_run.main([*RUN, "--json", str(run_json)]) == 0
        finally:
            dump.send_signal(2)
            _, err = dump.communicate(timeout=30)
    assert dump.returncode == 0, err


def test_a_capture_of_a_real_run_decodes_to_each_transfer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """D of TP 2 pulls P of TP 1: two pulls a request, each answered FINISH; every transfer is
    loaded, with the prompt's KV bytes on D asked for, and each reply answers its pull.
    ``--follow`` keeps one transfer's messages."""
    pcap, report = tmp_path / "run.pcap", tmp_path / "run.json"
    _capture(pcap, report)
    capsys.readouterr()
    assert cli.main(["decode", "--pcap", str(pcap)]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    # Only this run's: the other xdist worker's tests talk on loopback too.
    ours = {a.removeprefix("tcp://") for a in json.loads(report.read_text())["p_side_channel"]}
    records = [r for r in lines if r.get("p_worker") in ours]
    tids = {t for r in records for t in r.get("transfer_ids", ())}
    summaries = [r["summary"] for r in lines if r.get("summary", {}).get("transfer_id") in tids]
    assert len(ours) == 1 and len(summaries) == 3, (ours, summaries)
    kv = run.prompt_kv_bytes(SHAPE, 64)
    for row in summaries:
        assert row["verdict"] == "loaded" and row["pulls"] == row["replies"] == 2, row
        assert row["bytes"] == kv
    assert json.loads(report.read_text())["bytes_verified"] == 3 * kv
    pulls = [r for r in records if r["kind"] == "pull"]
    replies = [r for r in records if r["kind"] == "response"]
    assert len(pulls) == len(replies) == 6
    assert all(r["dir"] == "D->P" for r in pulls) and all(r["dir"] == "P->D" for r in replies)
    assert {r["conn"] for r in pulls} == {r["conn"] for r in replies}
    assert all(r["status"] == "FINISH" and r["answers"]["kind"] == "pull" for r in replies)
    assert {r["d_worker"].split()[-1] for r in pulls} == {"tp0", "tp1"}
    assert "loaded" in err
    # --follow: the pulls and replies of one transfer only
    first = pulls[0]["transfer_ids"][0]
    assert cli.main(["decode", "--pcap", str(pcap), "--follow", first]) == cli.EXIT_OK
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    shown = [r for r in shown if "summary" not in r and r["p_worker"] in ours]
    assert len(shown) == 4 and all(r["transfer_ids"] == [first] for r in shown)
