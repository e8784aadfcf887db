"""``pdwire conformance self``: the reference testees, started here, against every suite.

By default the reference P runs TP 2 (with its bootstrap server), the reference D TP 1 and
decodes from whatever KV its P writes (``--no-verify-kv``), as an engine with a real model does:
the consumer suite's fake P writes bytes of its own. Both run with short timers. A case that
needs other testees names them in ``LAYOUTS`` (a P of two PP stages, a D of TP 2), and the
authentication cases (§8.6) run against a P and D that share a key with the harness: each
layout gets testees of its own. The proxy and registration suites, whose cases start a
reference proxy or P of their own, run beside the layouts. A caller may add variables to the
environment of the testees of one kind (``Environ``), also of those the cases start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import shlex
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from pdwire.limits import REFERENCE
from pdwire.roles import Role
from pdwire.sim.geometry import Geometry

from . import testees
from .case import Case, Suite
from .command import with_env
from .runner import Result, RunOptions

RECEIVE_TIMEOUT = 3.0  # the reference D's receive timeout per pull
DECODE_FLAGS = ("--no-verify-kv", "--receive-timeout", str(RECEIVE_TIMEOUT))
AUTH_SECTION = "8.6"
#: The key the keyed testees share with the harness.
AUTH_KEY = b"pdwire conformance self"
#: What the testees of each kind ("prefill", "decode", "proxy") add to their environment.
Environ = Mapping[str, dict[str, str]]


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    """The reference testees a case runs against: their parallel sizes, and whether they share
    AUTH_KEY with the harness."""

    keyed: bool = False
    prefill_tp: int = 2
    prefill_pp: int = 1
    decode_tp: int = 1
    kv_heads: int = testees.KV_HEADS  # of the model: fewer than a TP size replicate the KV
    abort_timeout: float = testees.ABORT_TIMEOUT  # T of P and D
    prefill_delay: float = 0.0  # how long P's prefill takes (pdwire node --prefill-delay)
    kernel_block_size: int = 0  # the testees' kernel block size (10.6.6); 0: the block size
    sliding_window: int = 0  # the testees' sliding window over their odd layers (10.4.7); 0: none
    mamba: bool = False  # the testees' odd layers are state-space layers (10.6.3)
    packed_rows: bool = False  # the testees' regions are slices of packed rows (10.7.8)
    opaque_rows: bool = False  # the testees register their packed rows whole (10.6.7)
    lease: float = 0.0  # the testees' kv_lease_duration (§6.4); 0: none

    @property
    def geometry(self) -> Geometry:
        return Geometry(
            testees.LAYERS,
            self.kv_heads,
            testees.HEAD_DIM,
            testees.BLOCK_SIZE,
            kernel_block_size=self.kernel_block_size or None,
            sliding_window=self.sliding_window or None,
            mamba=self.mamba,
            packed_rows=self.packed_rows,
            opaque_rows=self.opaque_rows,
        )


DEFAULT: Final = Layout()
#: The testees of the authentication cases (§8.6), which need no P of TP 2.
KEYED: Final = Layout(keyed=True, prefill_tp=1)
#: The testees of the cases that need a P of several PP stages or a D of TP 2: one layout for
#: both, so that they share one start.
PARALLEL: Final = Layout(prefill_tp=1, prefill_pp=2, decode_tp=2)
#: The testees of the case of a P whose TP ranks replicate the KV (one KV head over TP 2).
REPLICATED: Final = Layout(kv_heads=1)
#: The testee of the case of a ready wait that restarts: a P whose prefill takes T/2.
SLOW_PREFILL: Final = Layout(prefill_tp=1, abort_timeout=3.0, prefill_delay=1.5)
#: The testees of the case of block ids that stand for kernel blocks (rows of half a block) and
#: of the cases of a sliding-window KV-cache group (a window of one block, of which a transfer
#: carries the prompt's last two blocks): one layout for both, so that they share one start.
KERNEL_WINDOW: Final = Layout(
    prefill_tp=1, kernel_block_size=testees.BLOCK_SIZE // 2, sliding_window=testees.BLOCK_SIZE
)
#: The testee of the cases of a state-space KV-cache group and of packed rows: one P for both.
#: The case that fills P's bootstrap server to its limit (13.6-R1) runs there too, last, since
#: no case after it may need to register: a layout with no other suite, and no start of its own.
PACKED_MAMBA: Final = Layout(prefill_tp=1, mamba=True, packed_rows=True)
#: The testee of the cases of packed rows registered whole, one region both KV-cache groups of a
#: sliding-window model share.
OPAQUE: Final = Layout(prefill_tp=1, sliding_window=testees.BLOCK_SIZE, opaque_rows=True)
#: The testees of the lease cases (§3.9, §6.4): a lease longer than T, so that a P which held a
#: transfer for T instead fails them, and short enough for quick cases.
LEASED: Final = Layout(prefill_tp=1, lease=3.0)
#: The cases that need testees of other sizes than DEFAULT's, and theirs.
LAYOUTS: Final[dict[str, Layout]] = {
    "producer/10.2/3": PARALLEL,
    "consumer/10.1/2": PARALLEL,
    "producer/10.8/5": REPLICATED,
    "producer/6.3/3": SLOW_PREFILL,
    "producer/10.6/2": KERNEL_WINDOW,
    "producer/10.4/4": KERNEL_WINDOW,
    "consumer/10.4/1": KERNEL_WINDOW,
    "consumer/10.10/5": KERNEL_WINDOW,
    "producer/10.6/3": PACKED_MAMBA,
    "producer/10.7/3": PACKED_MAMBA,
    "producer/13.6/1": PACKED_MAMBA,
    "producer/10.6/4": OPAQUE,
    "producer/10.2/4": OPAQUE,
    **{
        c: LEASED
        for c in (
            "producer/6.4/1",
            "producer/6.4/2",
            "producer/6.4/3",
            "producer/3.9/1",
            "consumer/6.4/1",
            "consumer/6.4/2",
            "consumer/3.9/1",
        )
    },
}


#: The suites whose cases start testees of their own (a reference proxy, a reference P).
BESIDE: Final = frozenset({Suite.PROXY, Suite.REGISTRATION})
#: The layouts whose cases time the testees' periodic timers to a fraction of a second (lease
#: renewals, a prefill of a set length): they run last, together, when the suites that run
#: beside the layouts (``BESIDE``) have ended.
LAST: Final = frozenset({LEASED, SLOW_PREFILL})


def layout_of(c: Case) -> Layout:
    """The testees ``c`` runs against."""
    return LAYOUTS.get(c.id, KEYED if c.section == AUTH_SECTION else DEFAULT)


def by_layout(cases: Sequence[Case]) -> dict[Layout, list[Case]]:
    """``cases`` by the testees they run against, DEFAULT's first."""
    out: dict[Layout, list[Case]] = {}
    for c in cases:
        out.setdefault(layout_of(c), []).append(c)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != DEFAULT, kv[0])))


def roles_for(cases: Sequence[Case]) -> set[Role]:
    """The testees the suites of ``cases`` need."""
    suites = {c.suite for c in cases}
    roles: set[Role] = set()
    if suites & {Suite.PRODUCER, Suite.PAIR}:
        roles.add("prefill")
    if suites & {Suite.CONSUMER, Suite.PAIR}:
        roles.add("decode")
    return roles


def start(
    role: Role,
    layout: Layout = DEFAULT,
    env: dict[str, str] | None = None,
    key_file: str = "",
) -> testees.Testee:
    """A reference testee of ``layout``, ``env`` added to its environment; with ``key_file``,
    sharing that key (§8.6)."""
    extra = ("--auth-key-file", key_file) if key_file else ()
    geometry = testees.geometry(layout.kv_heads)
    if layout.kernel_block_size:
        geometry = (*geometry, "--kernel-block-size", str(layout.kernel_block_size))
    if layout.sliding_window:
        geometry = (*geometry, "--sliding-window", str(layout.sliding_window))
    if layout.mamba:
        geometry = (*geometry, "--mamba")
    if layout.packed_rows:
        geometry = (*geometry, "--packed-rows")
    if layout.opaque_rows:
        geometry = (*geometry, "--opaque-rows")
    if layout.lease:
        extra = (*extra, "--kv-lease-duration", str(layout.lease))
    if role == "prefill":
        delay = ("--prefill-delay", str(layout.prefill_delay)) if layout.prefill_delay else ()
        return testees.start_node(
            role,
            tp=layout.prefill_tp,
            pp=layout.prefill_pp,
            env=env,
            extra=(*extra, *delay),
            abort_timeout=layout.abort_timeout,
            geometry=geometry,
        )
    return testees.start_node(
        role,
        tp=layout.decode_tp,
        env=env,
        extra=(*DECODE_FLAGS, *extra),
        abort_timeout=layout.abort_timeout,
        geometry=geometry,
    )


@dataclasses.dataclass
class Testbed:
    """The reference testees of one layout, by role."""

    layout: Layout = DEFAULT
    nodes: dict[Role, testees.Testee] = dataclasses.field(default_factory=dict)
    roles: set[Role] = dataclasses.field(default_factory=set)  # those it was started with
    key_file: str = ""  # the nodes share AUTH_KEY, kept in this file
    environ: Environ = dataclasses.field(default_factory=dict)  # also of the testees cases start

    @property
    def auth_key(self) -> bytes | None:
        return AUTH_KEY if self.key_file else None

    async def start(self, roles: set[Role]) -> None:
        """Start the nodes of ``roles`` at once (starting one is mostly waiting for its worker
        processes)."""
        self.roles = set(roles)
        if self.layout.keyed and not self.key_file:
            fd, self.key_file = tempfile.mkstemp(prefix="pdwire-conformance-", suffix=".key")
            with os.fdopen(fd, "wb") as f:
                f.write(AUTH_KEY)
        todo = sorted(roles)
        got = await asyncio.gather(
            *(
                asyncio.to_thread(start, r, self.layout, self.env_of(r), self.key_file)
                for r in todo
            ),
            return_exceptions=True,
        )
        for r, node in zip(todo, got, strict=True):
            if isinstance(node, testees.Testee):
                self.nodes[r] = node
        errors = [e for e in got if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    def env_of(self, kind: str) -> dict[str, str]:
        """What a testee of ``kind`` adds to its environment: a node of this testbed, or a
        proxy, P or D that a case starts from a reference command."""
        return self.environ.get(kind, {})

    async def restart(self, role: Role) -> None:
        node = self.nodes.pop(role, None)
        if node is not None:
            await asyncio.to_thread(node.stop)
        self.nodes[role] = await asyncio.to_thread(
            start, role, self.layout, self.env_of(role), self.key_file
        )

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in self.nodes.values()))
        self.nodes.clear()
        if self.key_file:
            Path(self.key_file).unlink(missing_ok=True)
            self.key_file = ""


def reference_d_command(env: dict[str, str] | None = None) -> str:
    """The template of the reference D that the consumer cases which start a D of their own
    start. Its engine id is fixed, so that a D which derived its layout_id from it would send
    the same one after a restart."""
    args = [
        "{python}", "-m", "pdwire", "node", "--role", "decode", "--port", "{port}",
        "--engine-id", "pdwire-conformance-d", *testees.GEOMETRY, *DECODE_FLAGS,
        "--abort-timeout", str(testees.ABORT_TIMEOUT),
    ]  # fmt: skip
    return with_env(shlex.join(args), env or {})


async def run_suites(
    bed: Testbed,
    cases: Sequence[Case],
    options: RunOptions,
    on_result: Callable[[Result], None] | None,
    timeout: float,
    *,
    side_by_side: bool = False,
) -> list[Result]:
    """Every suite of ``cases`` whose testees ``bed`` holds, against them. With
    ``side_by_side``, the producer suite (bed's P, a fake D) and the consumer suite (bed's D, a
    fake P), which share no testee, run at once, and so do the proxy and registration suites,
    which start their own; the pair suite runs after them, on both of bed's nodes."""
    wanted = {c.suite for c in cases}
    p, d = bed.nodes.get("prefill"), bed.nodes.get("decode")
    apart: list[Callable[[], Awaitable[list[Result]]]] = []
    if Suite.PRODUCER in wanted and p is not None:
        from .suites.producer_env import ProducerOptions
        from .suites.run import run_producer

        popts = ProducerOptions(
            api=p.url,
            bootstrap=p.bootstrap,
            geometry=bed.layout.geometry,
            abort_timeout=bed.layout.abort_timeout,
            kv_lease_duration=bed.layout.lease,
            request_timeout=timeout,
            auth_key=bed.auth_key,
            limits=REFERENCE.as_dict(),
        )
        apart.append(functools.partial(run_producer, popts, cases, options, on_result))
    if Suite.CONSUMER in wanted and d is not None:
        from .suites.consumer_env import ConsumerOptions, run_consumer

        copts = ConsumerOptions(
            api=d.url,
            abort_timeout=bed.layout.abort_timeout,
            receive_timeout=RECEIVE_TIMEOUT,
            kv_lease_duration=bed.layout.lease,
            request_timeout=timeout,
            auth_key=bed.auth_key,
            d_command=reference_d_command(bed.env_of("decode")),
            sliding_window=bed.layout.sliding_window or None,
        )
        apart.append(functools.partial(run_consumer, copts, cases, options, on_result))
    if Suite.PROXY in wanted:
        from .suites.proxy_env import reference_options, run_proxy

        proxyopts = reference_options(bed.env_of("proxy"), timeout)
        apart.append(functools.partial(run_proxy, proxyopts, cases, options, on_result))
    if Suite.REGISTRATION in wanted:
        from .suites import registration_env

        regopts = registration_env.reference_options(bed.env_of("prefill"), timeout)
        apart.append(
            functools.partial(registration_env.run_registration, regopts, cases, options, on_result)
        )
    results = await _all(apart, side_by_side)
    if Suite.PAIR in wanted and p is not None and d is not None:
        from .suites.pair_env import PairOptions, run_pair

        pairopts = PairOptions(
            prefill=p.url, prefill_bootstrap=p.bootstrap, decode=d.url, request_timeout=timeout
        )
        results += await run_pair(pairopts, cases, options, on_result)
    return results


async def _all(
    runs: Sequence[Callable[[], Awaitable[list[Result]]]], at_once: bool
) -> list[Result]:
    """The results of ``runs``, run at once or one after another."""
    if at_once:
        return [r for got in await asyncio.gather(*(run() for run in runs)) for r in got]
    return [r for run in runs for r in await run()]


@contextlib.asynccontextmanager
async def testbed(
    roles: set[Role], layout: Layout = DEFAULT, environ: Environ | None = None
) -> AsyncIterator[Testbed]:
    bed = Testbed(layout, environ=environ or {})
    try:
        await bed.start(roles)
        yield bed
    finally:
        await bed.stop()


async def _run_layouts(
    cases: Sequence[Case],
    options: RunOptions,
    on_result: Callable[[Result], None] | None,
    timeout: float,
) -> list[Result]:
    """``cases`` against the testbed of each layout they need, in stages (``stages``): the
    layouts of a stage run at once, the stages one after another. The next stage's testees
    start while the cases of one run, and a stage's testees stop while the next one's run:
    starting and stopping are mostly waiting for processes."""
    plan = by_layout(cases)
    order = stages(plan)
    results: list[Result] = []
    stopping: list[asyncio.Task[None]] = []
    starting: list[list[asyncio.Task[Testbed]]] = []
    handed: set[asyncio.Task[Testbed]] = set()  # those whose testbed is stopping

    def start_up_to(n: int) -> None:
        for stage in order[len(starting) : n]:
            starting.append(
                [asyncio.create_task(_started(lo, roles_for(plan[lo]))) for lo in stage]
            )

    async def run(bed: Testbed) -> list[Result]:
        try:
            return await run_suites(
                bed, plan[bed.layout], options, on_result, timeout, side_by_side=True
            )
        finally:
            stopping.append(asyncio.create_task(bed.stop()))

    start_up_to(1)
    try:
        for i in range(len(order)):
            beds = [await task for task in starting[i]]
            handed.update(starting[i])  # only once all started: else the finally stops them
            start_up_to(i + 2)
            for got in await asyncio.gather(*(run(bed) for bed in beds)):
                results += got
    finally:
        for task in [t for stage in starting for t in stage if t not in handed]:
            with contextlib.suppress(BaseException):  # one that failed stopped its nodes
                stopping.append(asyncio.create_task((await task).stop()))
        await asyncio.gather(*stopping)
    return results


def stages(plan: Mapping[Layout, Sequence[Case]]) -> list[list[Layout]]:
    """The layouts of ``plan`` in the order they run: each other layout alone, in ``plan``'s
    order (DEFAULT's first), then those of ``LAST`` together."""
    last = [layout for layout in plan if layout in LAST]
    return [[layout] for layout in plan if layout not in LAST] + ([last] if last else [])


async def _started(layout: Layout, roles: set[Role]) -> Testbed:
    """A testbed of ``layout`` with the nodes of ``roles`` running; none left running when one
    fails to start."""
    bed = Testbed(layout)
    try:
        await bed.start(roles)
    except BaseException:
        await bed.stop()
        raise
    return bed


async def run_self(
    cases: Sequence[Case],
    options: RunOptions,
    on_result: Callable[[Result], None] | None,
    timeout: float,
) -> list[Result]:
    """Every case of ``cases`` against the reference testees; the results in the order of
    ``cases``. The suites that start testees of their own (``BESIDE``) run beside the others:
    most of their time is waiting for those to start."""
    own = Testbed()
    beside = [c for c in cases if c.suite in BESIDE]
    alongside = asyncio.create_task(
        run_suites(own, beside, options, on_result, timeout, side_by_side=True)
    )
    try:
        rest = [c for c in cases if c.suite not in BESIDE]
        results = await _run_layouts(rest, options, on_result, timeout)
        results += await alongside
    finally:
        if not alongside.done():
            alongside.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await alongside
    order = {c.id: i for i, c in enumerate(cases)}
    return sorted(results, key=lambda r: order[r.case.id])
