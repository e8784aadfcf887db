"""An engine's place in a data-parallel deployment, and what follows from it for the bootstrap
server (spec §4.4): whether the engine serves one, where its P workers register, and the
``dp_rank`` they register with. vLLM's MooncakeConnector's rules, on plain values, so that the
vLLM connector and ``pdwire node`` share them."""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

LoadBalancing = Literal["internal", "hybrid", "external"]
LOAD_BALANCING: Final[tuple[LoadBalancing, ...]] = ("internal", "hybrid", "external")
LOOPBACK: Final = "127.0.0.1"
#: Bind addresses that name no one address: a server bound there is reached at ``bootstrap_host``.
ANY_HOST: Final = ("", "0.0.0.0", "::")


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """vLLM's ``data_parallel_index``, ``data_parallel_rank_local``, DP load balancing,
    ``data_parallel_master_ip``, ``master_addr`` and ``nnodes_within_dp``."""

    index: int = 0
    local_rank: int = 0
    load_balancing: LoadBalancing = "internal"
    master_ip: str = LOOPBACK
    master_addr: str = LOOPBACK
    nodes: int = 1  # how many nodes one DP rank spans

    @property
    def local_only(self) -> bool:
        """Engines local only: each node's engines are balanced apart from the others'."""
        return self.load_balancing != "internal"

    @property
    def rank(self) -> int:
        """The ``dp_rank`` this engine's workers register (4.4-R16)."""
        return self.local_rank if self.local_only else self.index

    @property
    def serves_bootstrap(self) -> bool:
        """Whether this engine's TP rank 0, PP rank 0 worker runs the bootstrap server, when no
        external one is configured (4.4-R13): one per node when local only, else one in all."""
        return self.rank == 0

    @property
    def bootstrap_host(self) -> str:
        """Where the workers register, when no external server is configured (4.4-R15)."""
        if self.local_only:
            return LOOPBACK
        return self.master_addr if self.nodes > 1 else self.master_ip

    def register_host(self, bind: str) -> str:
        """Where the workers register, the server being configured to bind ``bind``."""
        return self.bootstrap_host if bind in ANY_HOST else bind
