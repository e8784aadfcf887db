"""The generated parts of the spec match the code: schemas and golden vectors (which ship in the
package, pdwire/data/, and which spec/ links to), and the tables of spec/*.md."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from pdwire import schema, spectables, vectors
from pdwire.schema import HTTP_DOCUMENTS, MSGPACK_MESSAGES, schema_of, schemas

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec"
SCHEMAS = ROOT / "pdwire" / "data" / "schemas"
VECTORS = ROOT / "pdwire" / "data" / "vectors"


def test_the_packaged_files_are_the_repository_s_and_spec_links_to_them() -> None:
    assert Path(str(schema.packaged())).resolve() == SCHEMAS
    assert Path(str(vectors.packaged())).resolve() == VECTORS
    assert (SPEC / "schemas").is_symlink() and (SPEC / "schemas").resolve() == SCHEMAS
    assert (SPEC / "vectors").is_symlink() and (SPEC / "vectors").resolve() == VECTORS


@pytest.mark.parametrize("name", sorted(schemas()))
def test_schema_file_matches_code(name: str) -> None:
    path = SCHEMAS / name
    assert path.exists(), f"{path} missing: run `make schemas`"
    assert path.read_text() == schemas()[name], f"{path} drifted from the code: `make schemas`"


def test_no_stale_schema_files() -> None:
    on_disk = {p.name for p in SCHEMAS.glob("*.json")}
    assert on_disk == set(schemas())


@pytest.mark.parametrize("name", [*MSGPACK_MESSAGES, *HTTP_DOCUMENTS])
def test_schema_is_valid_2020_12(name: str) -> None:
    schema = schema_of(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_vector_files_match_code() -> None:
    for v in vectors.all_vectors():
        assert (VECTORS / f"{v.name}.msgpack").read_bytes() == v.data, v.name
        doc = json.loads((VECTORS / f"{v.name}.json").read_text())
        assert doc == v.document(), f"{v.name}.json drifted: `make vectors`"
    assert len(list(VECTORS.glob("*.json"))) == len(vectors.all_vectors())


@pytest.mark.parametrize("outcome", vectors.check(vectors.packaged()), ids=lambda o: o.name)
def test_golden_vector(outcome: vectors.Outcome) -> None:
    assert outcome.ok, outcome.detail


def test_vectors_cover_every_status_profile_and_kind() -> None:
    docs = [json.loads(p.read_text()) for p in VECTORS.glob("*.json")]
    statuses = {
        d["message"]["status"] for d in docs if d["decoder"] == "response" and "message" in d
    }
    assert statuses == {0, 1, 2, 3}
    for decoder in ("pull", "response", "cancel", "heartbeat"):
        assert any(d["decoder"] == decoder and "error" in d for d in docs), decoder
    assert {d.get("profile") for d in docs if d["decoder"] == "pull"} >= {"legacy", "pdwire/2"}
    traits = {t for d in docs for t in d.get("older_variants", [])}
    assert {"flat-block-lists", "no-block-lens", "no-layer-metadata", "no-layout-id"} <= traits


@pytest.mark.parametrize(
    "vector", [v for v in vectors.all_vectors() if v.error is None], ids=lambda v: v.name
)
def test_vector_message_validates_against_schema(vector: vectors.Vector) -> None:
    name = {
        "pull": "XferMetadataV2",
        "response": "XferResponseV2",
        "cancel": "XferCancel",
        "heartbeat": "LeaseHeartbeat",
    }
    jsonschema.validate(vectors.as_json(vector.message), schema_of(name[vector.decoder]))


def test_a_tampered_vector_fails_the_check(tmp_path: Path) -> None:
    vectors.write(tmp_path)
    target = tmp_path / "pull-legacy-minimal.msgpack"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))
    failed = {o.name for o in vectors.check(tmp_path) if not o.ok}
    assert failed == {"pull-legacy-minimal"}


@pytest.mark.parametrize("path", sorted(SPEC.glob("*.md")), ids=lambda p: p.name)
def test_spec_tables_are_current(path: Path) -> None:
    text = path.read_text()
    assert spectables.fill(text) == text, f"{path.name}: run `make spec-tables`"


def test_every_message_has_a_table_in_the_spec() -> None:
    text = "".join(p.read_text() for p in SPEC.glob("*.md"))
    for name in spectables.SENDERS:
        assert f"<!-- fields:{name} -->" in text, name
    assert "<!-- negotiation-table -->" in text


def test_fill_replaces_a_stale_table() -> None:
    stale = "x\n<!-- fields:XferCancel -->\nold\n<!-- /fields -->\ny\n"
    filled = spectables.fill(stale)
    assert "old" not in filled and "`cancel_reqs`" in filled
    assert spectables.fill(filled) == filled
