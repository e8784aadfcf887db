"""The pdwire command line, run in-process."""

from __future__ import annotations

import dataclasses
import json
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from pdwire import cli, encode_pull
from pdwire.vectors import seed_pull
from reference_connector import cli_node

VECTORS = Path(__file__).resolve().parents[2] / "pdwire" / "data" / "vectors"
NODE = EntryPoint("node", "reference_connector.cli_node", cli.COMMANDS_GROUP)


@dataclasses.dataclass(frozen=True)
class BrokenCommand:
    """An entry point of pdwire's commands whose module fails to import."""

    name: str
    error: ImportError

    def load(self) -> None:
        raise self.error


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", ["decode", "encode", "schema", "vectors", "spec-tables"])
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: pdwire " + command in capsys.readouterr().out


def test_decode_raw_and_hex_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = encode_pull(seed_pull())
    raw, hexed = tmp_path / "p.bin", tmp_path / "p.hex"
    raw.write_bytes(data)
    hexed.write_text(data.hex(" ", 16) + "\n")
    code, out_raw, _ = run(capsys, "decode", str(raw))
    assert code == 0
    code, out_hex, _ = run(capsys, "decode", str(hexed))
    assert code == 0
    assert json.loads(out_raw) == json.loads(out_hex)
    assert json.loads(out_raw)["kind"] == "pull"


def test_decode_names_a_vllm_034_heartbeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM 0.34's MooncakeLeaseHeartbeat, as msgspec writes it, is the kind ``heartbeat``."""
    data = tmp_path / "hb.hex"
    data.write_text((b"\x81\xb2lease_transfer_ids\x91\xa6xfer-1").hex())
    code, out, _ = run(capsys, "decode", str(data))
    assert code == 0
    assert json.loads(out)["kind"] == "heartbeat"
    assert json.loads(out)["message"] == {"lease_transfer_ids": ["xfer-1"]}


def test_decode_reports_invalid_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "decode", str(VECTORS / "bad-tp-rank.msgpack"))
    assert code == 1
    assert "$.remote_tp_rank" in err and "§3.2" in err


def test_decode_hints_at_json_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "decode", str(VECTORS / "pull-legacy-minimal.json"))
    assert code == 1
    assert "looks like JSON" in err


def test_encode_then_decode_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    message = {"status": 0, "ok_reqs": ["a"], "pdwire_version": 2, "err_codes": None}
    src = tmp_path / "m.json"
    src.write_text(json.dumps(message))
    for profile, keys in (
        ("legacy", {"status", "ok_reqs"}),
        ("pdwire/2", {"status", "ok_reqs", "pdwire_version"}),
    ):
        out = tmp_path / "m.bin"
        code, _, _ = run(
            capsys,
            "encode",
            "--kind",
            "response",
            "--profile",
            profile,
            "--out",
            str(out),
            str(src),
        )
        assert code == 0
        code, decoded, _ = run(capsys, "decode", str(out))
        assert code == 0
        assert set(json.loads(decoded)["message"]) == keys


def test_encode_refuses_a_cancel_under_legacy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "c.json"
    src.write_text(
        json.dumps(
            {
                "pdwire_version": 2,
                "remote_hostname": "h",
                "remote_port": 1,
                "remote_tp_size": 1,
                "remote_tp_rank": 0,
                "cancel_reqs": {"r": "t"},
            }
        )
    )
    code, _, err = run(
        capsys, "encode", "--kind", "cancel", "--profile", "legacy", "--hex", str(src)
    )
    assert code == 1
    assert "§8.4" in err


def test_schema_and_vectors_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schema", "--out", str(tmp_path / "s"))
    assert code == 0 and len(list((tmp_path / "s").glob("*.json"))) == 13
    code, _, _ = run(capsys, "vectors", "write", "--dir", str(tmp_path / "v"))
    assert code == 0
    code, out, _ = run(capsys, "vectors", "check", "--dir", str(tmp_path / "v"))
    assert code == 0 and out.strip().endswith("0 failed")
    (tmp_path / "v" / "pull-legacy-seed.msgpack").write_bytes(b"\xc1")
    code, out, _ = run(capsys, "vectors", "check", "--dir", str(tmp_path / "v"))
    assert code == 1 and "FAIL pull-legacy-seed" in out


def test_spec_tables_detects_and_fixes_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.md").write_text("<!-- fields:XferCancel -->\nstale\n<!-- /fields -->\n")
    code, out, _ = run(capsys, "spec-tables", "--dir", str(tmp_path))
    assert code == 1 and "out of date" in out
    code, _, _ = run(capsys, "spec-tables", "--dir", str(tmp_path), "--write")
    assert code == 0
    code, _, _ = run(capsys, "spec-tables", "--dir", str(tmp_path))
    assert code == 0


def test_missing_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "decode", "/nonexistent/file")
    assert code == 2 and "No such file" in err


def test_a_command_whose_extra_is_missing_explains_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = BrokenCommand("bootstrap", ImportError("No module named 'fastapi'"))
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken])
    code, _, err = run(capsys, "bootstrap")
    assert code == 2
    assert "fastapi" in err and "pdwire[runtime]" in err
    code, out, _ = run(capsys, "decode", str(VECTORS / "response-legacy-finish.msgpack"))
    assert code == 0 and '"kind": "response"' in out


def test_vectors_check_reads_the_packaged_vectors_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "vectors", "check")
    assert code == 0 and out.strip().endswith(" passed, 0 failed")


def test_vectors_write_needs_a_directory(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "vectors", "write")
    assert code == 2 and "--dir" in err


def test_an_unavailable_command_takes_any_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error = ModuleNotFoundError("No module named 'httpx'", name="httpx")
    monkeypatch.setattr(cli, "entry_points", lambda group: [BrokenCommand("conformance", error)])
    monkeypatch.setattr(cli, "missing", lambda extras: [])
    code, _, err = run(capsys, "conformance", "producer", "--p", "http://x")
    assert code == 2
    assert (
        err == "pdwire conformance: not installed: httpx; pip install 'pdwire[runtime,mooncake]'\n"
    )


def test_a_command_checks_its_extras_before_it_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its help names them; a missing package stops it before it starts anything."""
    started = []
    monkeypatch.setattr(cli, "entry_points", lambda group: [NODE])
    monkeypatch.setattr(cli, "missing", lambda extras: ["torch"] if "node" in extras else [])
    monkeypatch.setattr(cli_node, "run", lambda args: started.append(args) or 0)
    with pytest.raises(SystemExit):
        cli.main(["node", "--help"])
    assert "pip install 'pdwire[node]'" in capsys.readouterr().out
    code, _, err = run(capsys, "node", "--role", "decode")
    assert code == 2 and not started
    assert err == "pdwire node: not installed: torch; pip install 'pdwire[node]'\n"


def test_an_import_that_fails_while_a_command_runs_names_its_extras(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run_node(args: object) -> int:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(cli, "entry_points", lambda group: [NODE])
    monkeypatch.setattr(cli, "missing", lambda extras: [])
    monkeypatch.setattr(cli_node, "run", run_node)
    code, _, err = run(capsys, "node", "--role", "decode")
    assert code == 2
    assert err == "pdwire node: not installed: torch; pip install 'pdwire[node]'\n"
