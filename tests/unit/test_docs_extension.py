"""The docs' Sphinx extension (``docs/_ext/pdwire_docs``): its coverage check fails on a gap, the
spec's generated blocks become directives, and the diagrams are drawn from the code and data."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from docutils.core import publish_doctree

from pdwire import spectables
from pdwire.messages import ErrorCode, XferResponseStatus
from pdwire.transitions import TRANSFER_TRANSITIONS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

from pdwire_docs import coverage, sequence, spec_include, states  # noqa: E402
from pdwire_docs.coverage import Found  # noqa: E402

TIMERS = ("ready wait", "retention", "receive timeout")
ROUTES = ("POST /register", "GET /query")


def complete_site() -> dict[str, Found]:
    """Documents that cover everything the check asks for."""
    docs = {coverage.chapter_docname(p): Found() for p in coverage.SPEC_DIR.glob("*.md")}
    timer_rows: list[tuple[str, ...]] = [(t, "P", "480 s") for t in TIMERS]
    docs[coverage.TIMERS_DOC] = Found(rows=timer_rows)
    docs[coverage.ROUTES_DOC] = Found(titles=["4.1 POST /register", "4.2 GET /query", "4.4 x"])
    operation_rows: list[tuple[str, ...]] = [(item, "") for item in TIMERS + ROUTES]
    docs[coverage.OPERATIONS_DOC] = Found(rows=operation_rows)
    reference_rows: list[tuple[str, ...]] = [(str(s.value), s.name) for s in XferResponseStatus]
    docs["reference"] = Found(
        rows=reference_rows + [(c.value, "") for c in ErrorCode],
        fields={name: {r.name for r in spectables.rows(name)} for name in spectables.SENDERS},
        literals={f'"{text}"' for text in spectables.error_strings().values()},
    )
    return docs


def test_a_complete_site_has_no_gap() -> None:
    assert coverage.gaps(complete_site()) == []


def test_a_missing_field_is_a_gap() -> None:
    docs = complete_site()
    docs["reference"].fields["XferMetadata"].discard("layout_id")
    assert coverage.gaps(docs) == ["the site does not cover the field 'XferMetadata.layout_id'"]


def test_a_message_without_a_table_is_a_gap_per_field() -> None:
    docs = complete_site()
    del docs["reference"].fields["XferCancel"]
    gaps = coverage.gaps(docs)
    assert len(gaps) == len(spectables.rows("XferCancel"))
    assert all("'XferCancel." in gap for gap in gaps)


@pytest.mark.parametrize(
    ("category", "item", "remove"),
    [
        ("timer", "retention", lambda d: d[coverage.OPERATIONS_DOC].rows.remove(("retention", ""))),
        ("bootstrap route", "GET /query", lambda d: d[coverage.OPERATIONS_DOC].rows.pop()),
        ("status", "3 LAYOUT_MISS", lambda d: d["reference"].rows.remove(("3", "LAYOUT_MISS"))),
        ("error code", "INTERNAL", lambda d: d["reference"].rows.remove(("INTERNAL", ""))),
        (
            "error string",
            "Consumer deadline exceeded.",
            lambda d: d["reference"].literals.discard('"Consumer deadline exceeded."'),
        ),
        ("spec chapter", "spec/06-timers", lambda d: d.pop("spec/06-timers")),
    ],
)
def test_each_kind_of_gap_is_reported(
    category: str, item: str, remove: Callable[[dict[str, Found]], object]
) -> None:
    docs = complete_site()
    remove(docs)
    assert f"the site does not cover the {category} {item!r}" in coverage.gaps(docs)


def test_a_spec_chapter_that_lists_nothing_is_a_gap() -> None:
    docs = complete_site()
    docs[coverage.TIMERS_DOC] = Found()
    assert "the spec as built lists no timer: is its chapter missing?" in coverage.gaps(docs)


def test_collect_reads_rows_tagged_tables_titles_and_literals() -> None:
    doctree = publish_doctree(
        "Title\n=====\n\n"
        "====== =========\nfield  meaning\n====== =========\n"
        "``a``  first\n``b``  second\n====== =========\n\n"
        'And ``"Consumer deadline exceeded."`` in text.\n'
    )
    table = next(iter(doctree.findall(lambda n: n.tagname == "table")))
    table[coverage.MESSAGE_ATTR] = "XferCancel"
    found = coverage.collect(doctree)
    assert found.rows == [("a", "first"), ("b", "second")]
    assert found.fields == {"XferCancel": {"a", "b"}}
    assert found.titles == ["Title"]
    assert '"Consumer deadline exceeded."' in found.literals


def test_the_spec_markers_become_directives() -> None:
    for path in coverage.SPEC_DIR.glob("*.md"):
        text = spec_include.directives_for_markers(path.read_text())
        assert "<!-- fields:" not in text and "<!-- transitions:" not in text, path.name
        assert "<!-- negotiation-table -->" not in text, path.name
    text = (coverage.SPEC_DIR / "03-side-channel.md").read_text()
    assert "```{pdwire-fields} XferMetadata\n```" in spec_include.directives_for_markers(text)


def test_substitute_replaces_each_block_with_its_callback() -> None:
    text = (
        "a\n<!-- fields:XferCancel -->\nold\n<!-- /fields -->\n"
        "<!-- transitions:load -->\nold\n<!-- /transitions -->\n"
        "<!-- negotiation-table -->\nold\n<!-- /negotiation-table -->\nz\n"
    )
    out = spectables.substitute(
        text, fields=lambda n: f"F({n})", transitions=lambda m: f"T({m})", negotiation=lambda: "N"
    )
    assert out == "a\nF(XferCancel)\nT(load)\nN\nz\n"


def test_generated_lists_hold_every_status_code_and_string() -> None:
    statuses, codes, strings = (
        spectables.status_table(),
        spectables.error_code_table(),
        spectables.error_string_table(),
    )
    assert all(f"| {s.value} | `{s.name}` |" in statuses for s in XferResponseStatus)
    assert all(f"| `{c.name}` |" in codes for c in ErrorCode)
    assert all(f"`{text}`" in strings for text in spectables.error_strings().values())
    assert spectables.error_strings()["READY_TIMEOUT"] == "Timeout waiting for P side ready."
    assert "| `LAYOUT_NOT_CACHED` |" in strings and "`layout_id`, `remote_hostname`" in strings


def test_state_diagram_has_every_transition() -> None:
    dot = states.state_dot("transfer")
    for (state, event), nxt in TRANSFER_TRANSITIONS.items():
        source = "(none)" if state is None else state.value
        if source == nxt.value:
            assert f"&#8634; {event.value}" in dot  # listed inside the state
        else:
            edge = next(line for line in dot.splitlines() if f'"{source}" -> "{nxt.value}"' in line)
            assert event.value in edge
    assert '"forgotten" [label=<<b>forgotten</b>>, peripheries=2]' in dot


def test_the_request_sequence_has_its_43_steps_and_draws() -> None:
    seq = sequence.load(ROOT / "docs" / "_data" / "sequence.toml")
    assert [s.n for s in seq.steps] == list(range(1, 44))
    root = ET.fromstring(sequence.svg(seq))
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert all(any(t.startswith(f"{n}  ") for t in texts) for n in range(1, 44))


def test_the_sequence_rejects_an_unknown_participant(tmp_path: Path) -> None:
    path = tmp_path / "seq.toml"
    path.write_text(
        'participants = [{ id = "A", name = "a" }]\nphases = []\n'
        'steps = [{ n = 1, from = "A", to = "B", text = "x" }]\n'
    )
    with pytest.raises(ValueError, match="unknown participants"):
        sequence.load(path)
