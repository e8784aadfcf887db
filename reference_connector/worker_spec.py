"""What a node's worker process is started with (``WorkerSpec``), shared by the front's handle
(``node_worker``) and the process itself (``worker_process``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Final, Literal, get_args

from pdwire.messages import KV_LAYOUT_NAMES, Fingerprint
from pdwire.roles import Role
from pdwire.versions import PDWIRE_2, Profile

from .kv_content import KVShape

#: How a node's front starts its workers (``node_worker._context``).
WorkerStart = Literal["spawn", "fork"]
WORKER_STARTS: Final = get_args(WorkerStart)
#: What ``--worker-start`` means, in the help of the commands that take it.
WORKER_START_HELP: Final = (
    "how the workers start: 'spawn' (a new interpreter for a node of one worker; a forkserver "
    "that loads their modules once for several), or 'fork' from this process, quick where it "
    "has loaded the workers' modules already (the conformance harness forks its reference "
    "nodes from a process that has)"
)

POLL_S = 0.5  # how often a pipe reader looks up from its pipe


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs (picklable)."""

    role: Role
    shape: KVShape
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    engine_id: str
    bootstrap_url: str
    dp_rank: int = 0  # the dp_rank P's workers register (4.4-R16)
    host: str = "127.0.0.1"
    register_timeout: float = 30.0  # each HTTP phase of a registration attempt (4.4-R1)
    profile: Profile = PDWIRE_2
    model: str = "pdwire-synthetic"
    start_timeout: float = 120.0
    log_level: int = logging.INFO
    agent: str = ""  # MODULE:CALLABLE of the agent factory; "" = pdwire's own (worker_agents)
    start: WorkerStart = "spawn"  # how the front starts the worker (node_worker._context)
    abort_timeout: float = 480.0  # VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (§6)
    receive_timeout: float | None = None  # D, per pull; None = abort_timeout + 60 (3.1-R8)
    lease: float | None = None  # kv_lease_duration, P and D (§6.4); None = no lease
    auth_key: bytes | None = None  # the shared key of §8.6
    accepted_keys: tuple[bytes, ...] = ()  # older keys still accepted (8.6-R16)

    @property
    def name(self) -> str:
        return f"{self.role}-tp{self.tp_rank}-pp{self.pp_rank}"

    def fingerprint(self) -> Fingerprint | None:
        if self.profile != PDWIRE_2:
            return None
        s = self.shape
        return Fingerprint(
            model=self.model,
            dtype=s.dtype,
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_dim,
            block_size=s.block_size,
            kv_layout=KV_LAYOUT_NAMES[s.kv_layout],
        )
