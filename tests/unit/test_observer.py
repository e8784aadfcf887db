"""The side-channel observer: records and verdicts from the messages a tap or capture sees."""

from __future__ import annotations

import msgspec
import pytest

from pdwire import observer
from pdwire.codec import encode_cancel, encode_heartbeat, encode_pull, encode_response
from pdwire.messages import (
    LeaseHeartbeat,
    XferCancel,
    XferMetadata,
    XferResponse,
    XferResponseStatus,
)
from pdwire.observer import Observer, Seen
from pdwire.vectors import seed_pull

S = XferResponseStatus


def _pull(reqs: dict[str, tuple[str, list[list[int]]]], tp_rank: int = 0) -> bytes:
    msg = msgspec.structs.replace(
        seed_pull(), req_blocks=reqs, remote_tp_rank=tp_rank, remote_tp_size=2
    )
    return encode_pull(msg, "legacy")


def _reply(status: S, ok: list[str] | None = None, err: list[str] | None = None) -> bytes:
    msg = XferResponse(status, ok, err, "boom" if status is S.ERROR or err else None)
    return encode_response(msg, "legacy")


class Wire:
    """An observer and a clock: ``d`` and ``p`` record one message each way."""

    def __init__(self, follow: str | None = None) -> None:
        self.obs = Observer(follow)
        self.now = 100.0

    def d(self, conn: int, *frames: bytes) -> dict[str, object]:
        self.now += 0.001
        return self.obs.see(Seen(self.now, conn, True, "tp0/pp0", frames))

    def p(self, conn: int, *frames: bytes) -> dict[str, object]:
        self.now += 0.001
        return self.obs.see(Seen(self.now, conn, False, "tp0/pp0", frames))

    def verdicts(self) -> dict[str, str]:
        return {r["transfer_id"]: r["verdict"] for r in self.obs.summary(self.now)}


def test_a_reply_answers_the_pull_of_its_connection() -> None:
    w = Wire()
    pull = w.d(1, _pull({"r1": ("t1", [[1, 2]])}))
    assert pull["kind"] == "pull" and pull["dir"] == "D->P" and pull["transfer_ids"] == ["t1"]
    assert pull["d_worker"] == "127.0.0.1:15432 tp0"
    assert w.verdicts() == {"t1": "pending"}
    reply = w.p(1, _reply(S.FINISH, ["r1"]))
    assert reply["kind"] == "response" and reply["status"] == "FINISH"
    assert reply["answers"] == {"kind": "pull", "ms": 1.0} and reply["transfer_ids"] == ["t1"]
    (row,) = w.obs.summary(w.now)
    assert row["verdict"] == "loaded" and row["pulls"] == row["replies"] == 1
    assert row["blocks"] == 2 and row["ms"] == 1.0
    layout = observer.layout_of(seed_pull())
    assert layout is not None and row["bytes"] == observer.bytes_asked(layout, [[1, 2]]) > 0


def test_failures_name_the_message_and_an_error_fails_every_request_of_the_pull() -> None:
    w = Wire()
    w.d(1, _pull({"r1": ("t1", [[1]]), "r2": ("t2", [[2]])}))
    w.p(1, _reply(S.FINISH, ["r1"], ["r2"]))
    w.d(2, _pull({"r3": ("t3", [[3]]), "r4": ("t4", [[4]])}))
    w.p(2, _reply(S.ERROR))
    assert w.verdicts() == {"t1": "loaded", "t2": "failed", "t3": "failed", "t4": "failed"}
    failures = {r["transfer_id"]: r.get("failure") for r in w.obs.summary(w.now)}
    assert failures["t2"] == failures["t3"] == "boom" and failures["t1"] is None


def test_a_layout_miss_is_no_failure_and_continue_is_no_answer_yet() -> None:
    w = Wire()
    w.d(1, _pull({"r1": ("t1", [[1]])}))
    w.p(1, _reply(S.LAYOUT_MISS))
    assert w.verdicts() == {"t1": "loaded"}  # nothing waits: D sends its layout again
    w.d(2, _pull({"r1": ("t1", [[1]])}))
    w.p(2, _reply(S.CONTINUE, ["r1"]))
    assert w.verdicts() == {"t1": "pending"}
    w.p(2, _reply(S.FINISH, ["r1"]))
    assert w.verdicts() == {"t1": "loaded"}


def test_release_only_renewals_and_cancels_are_counted() -> None:
    w = Wire()
    w.d(1, _pull({"r1": ("t1", [[]])}))
    w.p(1, _reply(S.FINISH, ["r1"]))
    beat = w.d(2, encode_heartbeat(LeaseHeartbeat(["t2", "t3"])))
    assert beat["kind"] == "heartbeat" and beat["transfer_ids"] == ["t2", "t3"]
    assert w.p(2, _reply(S.FINISH))["answers"]["kind"] == "heartbeat"  # type: ignore[index]
    cancel = XferCancel(2, "127.0.0.1", 17000, 1, 0, {"r3": "t3"})
    assert w.d(3, encode_cancel(cancel, "pdwire/2"))["kind"] == "cancel"
    rows = {r["transfer_id"]: r for r in w.obs.summary(w.now)}
    assert rows["t1"]["verdict"] == "released" and rows["t1"]["blocks"] == 0
    assert rows["t2"]["verdict"] == "renewed only" and rows["t2"]["renewals"] == 1
    assert rows["t3"]["renewals"] == 1 and rows["t3"]["cancels"] == 1


def test_d_blocks_count_once_per_d_worker_over_the_p_workers_it_pulls() -> None:
    """A D worker of TP 1 pulls a P of TP 2: two pulls fill one set of D's blocks."""
    w = Wire()
    for conn, rank in ((1, 0), (2, 0), (3, 1)):
        w.d(conn, _pull({"r1": ("t1", [[1, 2, 3]])}, tp_rank=rank))
    for conn in (1, 2, 3):
        w.p(conn, _reply(S.FINISH, ["r1"]))
    (row,) = w.obs.summary(w.now)
    assert row["pulls"] == 3 and row["blocks"] == 6 and row["verdict"] == "loaded"


def test_what_cannot_be_decoded_is_shown_raw_and_older_messages_are_named() -> None:
    w = Wire()
    two = w.d(1, b"\x80", b"x")
    assert two["kind"] == "raw" and two["frames"] == ["80", "78"] and "2 frames" in two["error"]
    bad = w.d(2, b"\xc1")
    assert bad["kind"] == "raw" and bad["frames"] == ["c1"] and bad["error"]
    older = {"remote_hostname": "h", "remote_port": 1, "request_ids": ["a"], "block_ids": [[1]]}
    old = w.d(3, msgspec.msgpack.encode(older))
    assert old["kind"] == "vllm-0.14-pull" and old["message"] == older
    reply = w.p(3, b"trans_error")
    assert reply["kind"] == "vllm-0.14-reply" and reply["message"] == "trans_error"


def test_follow_shows_one_transfer_and_the_summary_keeps_all() -> None:
    w = Wire(follow="t2")
    records = [w.d(1, _pull({"r1": ("t1", [[1]])})), w.d(2, _pull({"r2": ("t2", [[2]])}))]
    records.append(w.p(2, _reply(S.FINISH, ["r2"])))
    assert [w.obs.shown(r) for r in records] == [False, True, True]
    assert set(w.verdicts()) == {"t1", "t2"}


def test_a_long_tap_forgets_its_oldest_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observer, "MAX_TRANSFERS", 2)
    w = Wire()
    for i in range(3):
        w.d(i, _pull({f"r{i}": (f"t{i}", [[i]])}))
    assert list(w.verdicts()) == ["t1", "t2"]


def test_bytes_asked_follow_each_region_group() -> None:
    msg = XferMetadata(
        remote_hostname="h",
        remote_port=1,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={},
        kv_caches_base_addr=[1, 2, 3],
        block_lens=[64, 64, 32],
        kv_block_lens=[48, 48, 32],
        registered_group_indices=[0, 1, 1],
    )
    layout = observer.layout_of(msg)
    assert layout == ((48, 0), (48, 1), (32, 1))
    assert observer.bytes_asked(layout, [[1, 2], [3]]) == 48 * 2 + 48 + 32


def test_a_pull_that_omits_its_layout_means_the_one_sent_under_its_layout_id() -> None:
    """§3.7: the first pull of a D worker to a P worker carries its layout under a layout_id,
    later ones only the id; another D worker's layout is not its own."""
    w = Wire()
    full = msgspec.structs.replace(seed_pull(), layout_id=7, req_blocks={"r1": ("t1", [[1]])})
    short = msgspec.structs.replace(
        full, req_blocks={"r2": ("t2", [[2]])}, kv_caches_base_addr=[], block_lens=[],
        kv_block_lens=[], registered_layer_names=[], registered_layer_indices=[],
        registered_group_indices=[], registered_shared_group_ids=[], registered_row_offsets=[],
    )  # fmt: skip
    other = msgspec.structs.replace(short, remote_port=1, req_blocks={"r3": ("t3", [[3]])})
    for conn, msg in enumerate((full, short, other)):
        w.d(conn, encode_pull(msg, "legacy"))
    rows = {r["transfer_id"]: r["bytes"] for r in w.obs.summary(w.now)}
    assert rows["t1"] == rows["t2"] > 0 and rows["t3"] == 0
