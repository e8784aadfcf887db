"""How a run is told the testee's limits (chapter 13): ``--limits FILE``, and P's size limit,
which ``--max-message-bytes`` also gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance import cli
from conformance.case import limits_from_file

BASE = ["producer", "--api", "http://127.0.0.1:1", "--bootstrap", "http://127.0.0.1:2"]


def _producer_limits(*extra: str) -> dict[str, int]:
    limits: dict[str, int] = cli.producer_options(cli.parse_args([*BASE, *extra])).limits
    return limits


def _file(tmp_path: Path, doc: object) -> str:
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_limits_file_is_read_by_name(tmp_path: Path) -> None:
    doc = {"requests_per_message": 4096, "message_bytes": 1 << 20}
    assert limits_from_file(_file(tmp_path, doc)) == doc
    assert limits_from_file(None) == {}


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"requests": 1}, "names no limit requests; known: "),
        ({"message_bytes": "1"}, "must hold a JSON object of integers"),
        ([1], "must hold a JSON object of integers"),
    ],
)
def test_a_bad_limits_file_says_why(tmp_path: Path, doc: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        limits_from_file(_file(tmp_path, doc))


def test_max_message_bytes_is_the_size_limit(tmp_path: Path) -> None:
    assert _producer_limits() == {}
    assert _producer_limits("--max-message-bytes", "1000") == {"message_bytes": 1000}
    path = _file(tmp_path, {"requests_per_message": 8, "message_bytes": 1000})
    both = _producer_limits("--max-message-bytes", "1000", "--limits", path)
    assert both == {"requests_per_message": 8, "message_bytes": 1000}
    other = _file(tmp_path, {"requests_per_message": 8})
    merged = _producer_limits("--max-message-bytes", "1000", "--limits", other)
    assert merged == {"requests_per_message": 8, "message_bytes": 1000}


def test_two_different_size_limits_are_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, {"message_bytes": 2000})
    with pytest.raises(SystemExit, match="--max-message-bytes 1000 and message_bytes 2000"):
        _producer_limits("--max-message-bytes", "1000", "--limits", path)
