"""The small world the session targets play in: one model geometry, a few D and P workers,
transfer ids and block lists, all chosen by the fuzz input."""

from __future__ import annotations

import dataclasses
from typing import Any, Final, TypeVar

from pdwire import Fingerprint, XferCancel, XferMetadata, XferMetadataV2, XferResponseV2, sign
from pdwire.planning import Side, layout_of
from pdwire.session import Session
from pdwire.sim.geometry import Geometry
from pdwire.versions import ALL_CAPS

from .reader import Reader

GEOM: Final = Geometry(num_layers=4, num_kv_heads=8, head_dim=16, block_size=16, num_blocks=64)
FP: Final = GEOM.fingerprint("tiny")
OTHER_FP: Final = dataclasses.replace(FP, num_layers=5)
KEY: Final = b"fuzz-shared-key"
WRONG_KEY: Final = b"not-the-key"
T: Final = 480.0
CAPS: Final = tuple(sorted(ALL_CAPS))
TPS: Final = (1, 2, 4)
PPS: Final = (1, 2)
#: Time steps: none, small, past a D deadline, past P's retention timer, past D's receive timer.
STEPS: Final = (0.0, 0.0, 0.5, 5.0, 61.0, T + 1, T + 61)
BLOCKS: Final[tuple[list[list[int]], ...]] = ([[5, 6]], [], [[1, 2, 3]], [[7]], [[1], [2]], [[]])
MAX_STEPS: Final = 48


def side(r: Reader, worker: int) -> tuple[Side, int]:
    """A worker's side of random TP/PP shape, and its PP rank."""
    tp, pp = r.choice(TPS), r.choice(PPS)
    rank, pp_rank = r.below(tp), r.below(pp)
    return GEOM.side(tp, rank, pp, pp_rank, worker=worker + pp_rank * 16 + rank), pp_rank


def caps(r: Reader) -> frozenset[str]:
    return frozenset(r.subset(CAPS)) if r.flag() else ALL_CAPS


def layout(s: Side, with_layout: bool) -> dict[str, Any]:
    return layout_of(s.regions if with_layout else ())


@dataclasses.dataclass(frozen=True)
class DWorker:
    """A D worker as P sees it through its pulls and cancels."""

    side: Side
    pp_rank: int
    host: str
    port: int

    def pull(
        self, r: Reader, reqs: dict[str, tuple[str, list[list[int]]]]
    ) -> XferMetadata | XferMetadataV2:
        with_layout = r.below(4) != 0
        fields: dict[str, Any] = {
            "remote_hostname": self.host,
            "remote_port": self.port,
            "remote_tp_size": self.side.tp_size,
            "remote_tp_rank": self.side.tp_rank,
            "req_blocks": reqs,
            **layout(self.side, with_layout),
            "remote_pp_size": r.choice((self.side.pp_size, self.side.pp_size, 1)),
            "layout_id": r.choice((0, 0x11)),
        }
        if not r.flag():
            return XferMetadata(**fields)
        fp: Fingerprint | None = r.choice((None, FP, OTHER_FP))
        msg = XferMetadataV2(
            **fields,
            pdwire_version=r.choice((2, 2, 3)),
            pdwire_caps=sorted(caps(r)),
            fingerprint=fp if with_layout else None,
            deadline_ms=r.choice((0, 0, 3_000, 1)),
        )
        return signed(r, msg)

    def cancel(self, r: Reader, reqs: dict[str, str]) -> XferCancel:
        msg = XferCancel(
            pdwire_version=2,
            remote_hostname=self.host,
            remote_port=self.port,
            remote_tp_size=self.side.tp_size,
            remote_tp_rank=self.side.tp_rank,
            cancel_reqs=reqs,
            remote_pp_size=self.side.pp_size,
            remote_pp_rank=self.pp_rank,
            reason="fuzz",
        )
        return signed(r, msg)


M = TypeVar("M", XferMetadataV2, XferCancel, XferResponseV2)


def signed(r: Reader, msg: M) -> M:
    """``msg`` unsigned, signed with the shared key, or signed with a wrong one."""
    key = r.choice((None, KEY, KEY, WRONG_KEY))
    return msg if key is None else sign(msg, key)


def live_timers(session: Session[Any, Any]) -> set[tuple[str, Any]]:
    """The (kind, what) of every timer that will still fire."""
    return {(e[2], e[3]) for e in session._timers if session._timer_live(e)}
