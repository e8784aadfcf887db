"""``PdwireConnector``'s worker half: a P worker and a D worker in this process, each as vLLM's
model runner drives it (``register_kv_caches`` with CPU caches of the CPU backend's layout,
connector metadata bound, ``start_load_kv``, ``get_transfer_results``), over real ZMQ, the
Mooncake engine on loopback TCP and P's own FastAPI bootstrap server. D's blocks must end up
byte for byte equal to P's; failures come back as failed loads with their blocks."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import set_current_vllm_config
from vllm.distributed import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    init_distributed_environment,
    parallel_state,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from conformance.ports import free_port
from reference_connector.vllm.connector import PdwireConnector
from reference_connector.vllm.metadata import Load, NoSend, PdwireConnectorMetadata, Send

from . import offline as h

pytestmark = pytest.mark.vllm
pytest.importorskip("mooncake.engine")

LAYERS: Final = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
HEADS: Final = 2
WAIT_S: Final = 20.0
#: P's ready wait where a case checks that P answers before it: longer than any wait here.
READY_WAIT_S: Final = 30.0
P_BLOCKS: Final = [5, 6, 7]
D_BLOCKS: Final = [20, 21, 40]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """vLLM's parallel state for one process (TP 1, PP 1), as a worker process has it."""
    path = h.model_dir(tmp_path_factory.mktemp("model"))
    config = h.vllm_config(path, "kv_both")
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
    yield path
    destroy_model_parallel()
    destroy_distributed_environment()


class _Stage:
    """What ``get_pp_group()`` answers about a PP stage."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in_group, self.world_size = rank, size


class Worker:
    """One connector in the WORKER role at (TP rank, PP stage) of its engine, with the CPU KV
    caches of its heads and layers; vLLM's parallel state answers for that position while the
    connector is built."""

    def __init__(
        self,
        model: Path,
        role: str,
        engine_id: str,
        extra: dict[str, Any],
        bootstrap_port: int,
        tp: tuple[int, int] = (0, 1),
        pp: tuple[int, int] = (0, 1),
    ) -> None:
        self.engine_id = engine_id
        self.tp, self.pp = tp, pp
        self.layers = LAYERS[pp[0] :: pp[1]]
        heads = HEADS // tp[1]
        config = h.vllm_config(model, role, engine_id=engine_id, extra=extra)
        kv_config = h.kv_cache_config(self.layers, heads)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(bootstrap_port))
            mp.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp[0])
            mp.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp[1])
            mp.setattr(parallel_state, "get_pp_group", lambda: _Stage(*pp))
            self.connector = PdwireConnector(config, KVConnectorRole.WORKER, kv_config)
        shape = (h.NUM_BLOCKS, heads, h.BLOCK_SIZE, 2 * h.HEAD_DIM)
        self.caches = {name: torch.zeros(shape) for name in self.layers}
        self.sent: set[str] = set()
        self.received: set[str] = set()
        self.failed: set[str] = set()
        self.bad_blocks: set[int] = set()
        self.stats: KVConnectorStats | None = None  # added up over the steps, as vLLM's logger
        try:
            self.connector.register_kv_caches(self.caches)
        except BaseException:
            self.stop()
            raise

    def step(self, meta: PdwireConnectorMetadata | None = None) -> None:
        """One engine step as the model-runner mixin runs it."""
        self.connector.bind_connector_metadata(meta or PdwireConnectorMetadata())
        self.connector.start_load_kv(None)  # type: ignore[arg-type]
        results = self.connector.get_transfer_results(set())
        self.bad_blocks |= self.connector.get_block_ids_with_load_errors()
        self.connector.clear_connector_metadata()
        stats = self.connector.get_kv_connector_stats()
        if stats is not None:
            data = PdwireConnector.build_kv_connector_stats(stats.to_dict())  # as vLLM ships it
            self.stats = data if self.stats is None else self.stats.aggregate(data)
        self.sent |= results.finished_sending
        self.received |= results.finished_recving
        self.failed |= results.failed_recving

    def pulls_received(self) -> int:
        worker = self.connector.worker
        producer = worker.producer if worker is not None else None
        return 0 if producer is None else producer.pulls_received

    def stop(self) -> None:
        self.connector.shutdown()


Engine = list[Worker]


@pytest.fixture
def make_engine(model: Path) -> Iterator[Any]:
    """``make_engine(role, profile, tp=1, pp=1, extra={...}, port=...)``: every worker of one
    engine (TP rank 0 first, which starts P's bootstrap server on ``port``); all of them are
    shut down after the test."""
    made: list[Worker] = []

    def make(
        role: str,
        profile: str,
        *,
        port: int,
        tp: int = 1,
        pp: int = 1,
        extra: dict[str, Any] | None = None,
    ) -> Engine:
        engine_id = f"engine-{uuid.uuid4().hex[:8]}"
        options = {"profile": profile, "bootstrap_host": "127.0.0.1", **(extra or {})}
        workers = []
        for stage in range(pp):
            for rank in range(tp):
                worker = Worker(model, role, engine_id, options, port, (rank, tp), (stage, pp))
                made.append(worker)
                workers.append(worker)
        return workers

    yield make
    for worker in reversed(made):
        worker.stop()


Pair = tuple[Worker, Worker, str]


@pytest.fixture
def make_pair(make_engine: Any) -> Any:
    """``make_pair(profile, p={...}, d={...})``: a P worker, a D worker and P's bootstrap URL."""

    def make(
        profile: str, p: dict[str, Any] | None = None, d: dict[str, Any] | None = None
    ) -> Pair:
        port = free_port()
        (producer,) = make_engine("kv_producer", profile, port=port, extra=p)
        (consumer,) = make_engine("kv_consumer", profile, port=port, extra=d)
        return producer, consumer, f"http://127.0.0.1:{port}"

    return make


def until(condition: Any, *workers: Worker, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        for w in workers:
            w.step()
        time.sleep(0.01)


def load(d: Worker, p: Worker, url: str, blocks: list[int], req: str = "d-1") -> None:
    d.step(PdwireConnectorMetadata(loads=[Load(req, "xfer-1", p.engine_id, url, [blocks])]))


def fill(p: Worker) -> None:
    for cache in p.caches.values():
        cache.copy_(torch.randn_like(cache))


def assert_copied(p: Worker, d: Worker) -> None:
    for name in LAYERS:
        assert torch.equal(d.caches[name][D_BLOCKS], p.caches[name][P_BLOCKS]), name


@pytest.mark.parametrize("profile", ["pdwire/2", "legacy"])
def test_d_receives_every_byte_of_p_blocks(make_pair: Any, profile: str) -> None:
    p, d, url = make_pair(profile)
    fill(p)
    p.step(PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1")]))
    load(d, p, url, D_BLOCKS)  # D's pull may come before P's prefill is done
    p.step(PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1", [P_BLOCKS])]))
    until(lambda: "d-1" in d.received and "p-1" in p.sent, p, d)
    assert not d.failed and not d.bad_blocks
    assert_copied(p, d)


def test_the_stats_count_the_transfer_for_vllm_s_logger_and_metrics(make_pair: Any) -> None:
    """What each worker counted reaches vLLM's stats path (its logger's summary, and its
    Prometheus counters through the connector's ``build_prom_metrics``)."""
    p, d, url = make_pair("pdwire/2")
    p.step(PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1")]))
    load(d, p, url, D_BLOCKS)
    p.step(PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1", [P_BLOCKS])]))
    until(lambda: "d-1" in d.received and "p-1" in p.sent, p, d)
    for w in (p, d):  # a step more: the counts of the step that completed it
        w.step()
    assert p.stats is not None and d.stats is not None
    nbytes = sum(c[P_BLOCKS].numel() * c.element_size() for c in p.caches.values())
    p_summary, d_summary = p.stats.reduce(), d.stats.reduce()
    assert p_summary["p_writes[ok]"] == p_summary["p_replies_sent[FINISH]"] == 1
    assert p_summary["p_written_bytes"] == nbytes and p_summary["p_write_count"] == 1
    assert d_summary["d_messages_sent[pull]"] == d_summary["d_loads[loaded]"] == 1
    assert d_summary["d_pull_count"] == 1 and d_summary["d_pull_mean_ms"] > 0
    registry = CollectorRegistry()
    kinds = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    prom = PdwireConnector.build_prom_metrics(
        p.connector._vllm_config,
        kinds,
        ["engine"],
        {0: ["0"]},  # type: ignore[arg-type]
    )
    prom.observe(p.stats.to_dict(), 0)
    prom.observe(d.stats.to_dict(), 0)
    value = registry.get_sample_value
    assert value("pdwire_p_writes_total", {"engine": "0", "result": "ok"}) == 1
    assert value("pdwire_p_written_bytes_total", {"engine": "0"}) == nbytes
    assert value("pdwire_d_loads_total", {"engine": "0", "outcome": "loaded"}) == 1
    assert 0 < value("pdwire_d_pull_seconds_total", {"engine": "0"}) < WAIT_S


@pytest.mark.parametrize("profile", ["pdwire/2", "legacy"])
def test_will_not_send_fails_the_load(make_pair: Any, profile: str) -> None:
    """A stop token as P's only token: P answers D's waiting pull at once, in both profiles
    (to a legacy D as FINISH with the request in err_reqs), not when its ready wait ends."""
    p, d, url = make_pair(profile, p={"abort_timeout": READY_WAIT_S})
    p.step(PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1")]))
    t0 = time.monotonic()
    load(d, p, url, D_BLOCKS)
    p.step(PdwireConnectorMetadata(no_sends=[NoSend("xfer-1", "p-1", "FINISHED_STOPPED")]))
    until(lambda: "d-1" in d.received, p, d)
    took = time.monotonic() - t0
    assert d.failed == {"d-1"}
    assert d.bad_blocks == set(D_BLOCKS)
    assert not p.sent  # its blocks were freed by the scheduler, not reported
    assert took < READY_WAIT_S  # answered before P's ready wait could have ended


def test_deadline_ms_gives_up_the_load(make_pair: Any) -> None:
    """P never finishes its prefill; D gives up when the request's deadline_ms passes and
    reports the load failed, its blocks free at once (P accepted D's cancel)."""
    p, d, url = make_pair("pdwire/2")
    p.step(PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1")]))
    t0 = time.time()
    meta = Load("d-1", "xfer-1", p.engine_id, url, [D_BLOCKS], deadline=t0 + 0.3)
    d.step(PdwireConnectorMetadata(loads=[meta]))
    until(lambda: "d-1" in d.received, p, d)
    assert 0.3 <= time.time() - t0 < 3.0
    assert d.failed == {"d-1"} and d.bad_blocks == set(D_BLOCKS)


def test_unknown_engine_fails_the_load(make_pair: Any) -> None:
    _, d, url = make_pair("pdwire/2")
    d.step(PdwireConnectorMetadata(loads=[Load("d-1", "xfer-1", "no-such-engine", url, [[3]])]))
    until(lambda: "d-1" in d.received, d)
    assert d.failed == {"d-1"} and d.bad_blocks == {3}


def test_release_only_pull_frees_p(make_pair: Any) -> None:
    """D ended its request before it was scheduled: an empty pull, and P frees its blocks."""
    p, d, url = make_pair("pdwire/2")
    p.step(
        PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1"), Send("xfer-1", "p-1", [P_BLOCKS])])
    )
    load(d, p, url, [])
    until(lambda: "p-1" in p.sent, p, d)
    d.step()
    assert not d.received and not d.failed  # nothing was waiting on D


@pytest.mark.parametrize("profile", ["pdwire/2", "legacy"])
def test_d_abort_while_waiting_for_p(make_pair: Any, profile: str) -> None:
    """D's request is aborted while P has not finished its prefill: D's blocks come back
    (without a failure: the request is gone); with pdwire/2 D cancels, so P frees its blocks
    at once when its prefill ends; legacy P serves the pull then."""
    p, d, url = make_pair(profile)
    p.step(PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1")]))
    load(d, p, url, D_BLOCKS)
    until(
        lambda: (
            p.connector.worker is not None
            and p.connector.worker.producer is not None
            and p.connector.worker.producer.pulls_received >= 1
        ),
        p,
        d,
    )
    d.step(PdwireConnectorMetadata(aborts=["d-1"]))
    if profile == "pdwire/2":
        until(lambda: "d-1" in d.received, p, d)
    p.step(PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1", [P_BLOCKS])]))
    until(lambda: "d-1" in d.received and "p-1" in p.sent, p, d)
    assert not d.failed and not d.bad_blocks


def _send(workers: Engine, blocks: list[int]) -> None:
    for w in workers:
        w.step(
            PdwireConnectorMetadata(sends=[Send("xfer-1", "p-1"), Send("xfer-1", "p-1", [blocks])])
        )


def _load(workers: Engine, engine_id: str, url: str) -> None:
    for w in workers:
        w.step(PdwireConnectorMetadata(loads=[Load("d-1", "xfer-1", engine_id, url, [D_BLOCKS])]))


def _settled(p: Engine, d: Engine) -> None:
    """Every D worker loaded the request and every P worker freed it."""
    until(lambda: all("d-1" in w.received for w in d) and all("p-1" in w.sent for w in p), *p, *d)
    assert not any(w.failed for w in d)


@pytest.mark.parametrize("profile", ["pdwire/2", "legacy"])
def test_p_tp1_to_d_tp2(make_engine: Any, profile: str) -> None:
    """Each D rank pulls its own head from the one P rank, which frees after both pulls."""
    port = free_port()
    (p,) = make_engine("kv_producer", profile, port=port)
    d = make_engine("kv_consumer", profile, port=port, tp=2)
    fill(p)
    _load(d, p.engine_id, f"http://127.0.0.1:{port}")
    _send([p], P_BLOCKS)
    _settled([p], d)
    for rank, w in enumerate(d):
        for name in LAYERS:
            want = p.caches[name][P_BLOCKS][:, rank : rank + 1]
            assert torch.equal(w.caches[name][D_BLOCKS], want), (rank, name)


def test_p_tp2_to_d_tp1(make_engine: Any) -> None:
    """The D rank pulls from both P ranks (each registered at the bootstrap server that P's TP
    rank 0 runs): each writes its head into D's block."""
    port = free_port()
    p = make_engine("kv_producer", "pdwire/2", port=port, tp=2)
    (d,) = make_engine("kv_consumer", "pdwire/2", port=port)
    for w in p:
        fill(w)
    _send(p, P_BLOCKS)
    _load([d], p[0].engine_id, f"http://127.0.0.1:{port}")
    _settled(p, [d])
    for name in LAYERS:
        want = torch.cat([w.caches[name][P_BLOCKS] for w in p], dim=1)
        assert torch.equal(d.caches[name][D_BLOCKS], want), name


def test_p_pp2_to_d_pp1(make_engine: Any) -> None:
    """P's two pipeline stages hold one layer each; D, one stage, pulls from both."""
    port = free_port()
    p = make_engine("kv_producer", "pdwire/2", port=port, pp=2)
    (d,) = make_engine("kv_consumer", "pdwire/2", port=port)
    for w in p:
        fill(w)
    _send(p, P_BLOCKS)
    _load([d], p[0].engine_id, f"http://127.0.0.1:{port}")
    _settled(p, [d])
    for w in p:
        (name,) = w.layers
        assert torch.equal(d.caches[name][D_BLOCKS], w.caches[name][P_BLOCKS]), name
