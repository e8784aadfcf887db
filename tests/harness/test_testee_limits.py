"""A testee's limit is not a protocol failure: a D that refuses chat completions on its own, as
vLLM does for a model without a chat template, leaves the chat case unsupported, with the
reason, while every other pair case runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance import cli, testees
from tests import suite_report

pytestmark = pytest.mark.conformance
pytest.importorskip("mooncake.engine")

CHAT = "pair/5.2/3"


@pytest.fixture
def pair_without_chat() -> Iterator[tuple[testees.Testee, testees.Testee]]:
    p = testees.start_node("prefill")
    d = testees.start_node("decode", extra=["--no-chat-template"])
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()


def test_a_d_without_a_chat_template_leaves_the_chat_case_unsupported(
    pair_without_chat: tuple[testees.Testee, testees.Testee], tmp_path: Path
) -> None:
    p, d = pair_without_chat
    code, doc = suite_report.run(
        tmp_path, "pair",
        ["pair", "--prefill", f"{p.url}@{p.bootstrap}", "--decode", d.url,
         "--cases", f"{CHAT},pair/5.2/1"],
    )  # fmt: skip
    cases = suite_report.cases(doc)
    assert code == cli.EXIT_OK
    assert cases["pair/5.2/1"]["verdict"] == "pass"
    assert cases[CHAT]["verdict"] == "unsupported", cases[CHAT]["detail"]
    assert "D refuses the request on its own too (HTTP 400" in cases[CHAT]["detail"]
    assert "chat template" in cases[CHAT]["detail"]
