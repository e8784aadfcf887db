"""Where the engines of a data-parallel deployment serve and find the bootstrap server (spec
4.4-R13, R15, R16), as pdwire node and the vLLM connector decide it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from reference_connector.dp_placement import DataParallel
from reference_connector.vllm.config import Settings
from reference_connector.vllm.position import Position, bootstrap_url, owns_bootstrap

IP, ADDR = "10.0.0.2", "10.0.0.3"

# (place, dp_rank registered, serves the bootstrap server, where the workers register)
CASES = [
    (DataParallel(), 0, True, "127.0.0.1"),
    (DataParallel(3, 1, "hybrid", IP, ADDR), 1, False, "127.0.0.1"),
    (DataParallel(2, 0, "external", IP, ADDR), 0, True, "127.0.0.1"),
    (DataParallel(2, 0, "internal", IP, ADDR), 2, False, IP),
    (DataParallel(0, 0, "internal", IP, ADDR), 0, True, IP),
    (DataParallel(1, 1, "internal", IP, ADDR, nodes=2), 1, False, ADDR),
]


@pytest.mark.parametrize(("place", "rank", "serves", "host"), CASES)
def test_rank_server_and_address_follow_the_deployment(
    place: DataParallel, rank: int, serves: bool, host: str
) -> None:
    assert (place.rank, place.serves_bootstrap, place.bootstrap_host) == (rank, serves, host)


def test_a_server_bound_to_one_address_is_registered_at_that_address() -> None:
    place = DataParallel(2, 0, "internal", IP, ADDR)
    assert place.register_host("0.0.0.0") == IP
    assert place.register_host("10.9.9.9") == "10.9.9.9"


def _vllm_config(place: DataParallel) -> SimpleNamespace:
    parallel = SimpleNamespace(
        data_parallel_index=place.index,
        data_parallel_rank_local=place.local_rank,
        local_engines_only=place.local_only,
        data_parallel_master_ip=place.master_ip,
        master_addr=place.master_addr,
        nnodes_within_dp=place.nodes,
    )
    return SimpleNamespace(parallel_config=parallel)


@pytest.mark.parametrize(("place", "rank", "serves", "host"), CASES)
def test_the_vllm_connector_places_its_engine_alike(
    place: DataParallel, rank: int, serves: bool, host: str
) -> None:
    config: object = _vllm_config(place)
    settings = Settings(bootstrap_port=8998)
    pos = Position("e", rank, 0, 1, 0, 1, "127.0.0.1")
    assert owns_bootstrap(config, settings, pos) is serves  # type: ignore[arg-type]
    assert bootstrap_url(config, settings) == f"http://{host}:8998"  # type: ignore[arg-type]
    worker = dataclasses.replace(pos, tp_rank=1)
    assert not owns_bootstrap(config, settings, worker)  # type: ignore[arg-type]
