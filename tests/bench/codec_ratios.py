"""pdwire's codec against bare msgspec (identical structs) and a pydantic JSON model.

Run from the repository root: ``python -m tests.bench.codec_ratios [--quick] [--json PATH]``.
Each case times the three implementations in alternating repeats and keeps the best of each.
The target is pdwire <= 1.05x bare msgspec; nothing here asserts timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import sys
import timeit
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec
from pydantic import BaseModel, Field

import pdwire
from pdwire import (
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseStatus,
    XferResponseV2,
)
from pdwire.vectors import seed_pull

BLOCKS_PER_REQUEST: Final = 63
SEED: Final = 20_240_601
#: A layout_id as a vLLM 0.33+ D sends it once P holds its layout (odd, 63 bits).
LAYOUT_ID: Final = 0x2545_F491_4F6C_DD1D

IMPLS: Final = ("pdwire", "msgspec", "pydantic")
#: ``decode+encode`` is what a relay does with a received message: decode it, then encode the
#: decoded value again (pdwire: to legacy bytes, equal to the bytes received).
OPS: Final = ("encode", "decode", "encode+decode", "decode+encode")
STMTS: Final = {
    "encode": "enc(msg)",
    "decode": "dec(data)",
    "encode+decode": "dec(enc(msg))",
    "decode+encode": "enc(dec(data))",
}


# -- pydantic mirrors -------------------------------------------------------------------------

NonNeg = Annotated[int, Field(ge=0)]
MinusOneOrMore = Annotated[int, Field(ge=-1)]


class PullModel(BaseModel):
    remote_hostname: str
    remote_port: Annotated[int, Field(ge=1, le=65535)]
    remote_tp_size: Annotated[int, Field(ge=1)]
    remote_tp_rank: NonNeg
    req_blocks: dict[str, tuple[str, list[list[NonNeg]]]]
    kv_caches_base_addr: list[NonNeg]
    block_lens: list[NonNeg]
    kv_block_lens: list[NonNeg]
    registered_layer_names: list[str] = []
    registered_layer_indices: list[NonNeg] = []
    registered_group_indices: list[MinusOneOrMore] = []
    registered_shared_group_ids: list[list[NonNeg]] = []
    registered_row_offsets: list[MinusOneOrMore] = []
    remote_pp_size: Annotated[int, Field(ge=1)] = 1
    layout_id: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0


class ResponseModel(BaseModel):
    status: XferResponseStatus
    ok_reqs: list[str] | None = None
    err_reqs: list[str] | None = None
    err_msg: str | None = None
    layout_id: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0


# -- workloads --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Codec:
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    msg: XferMetadata | XferResponse
    codecs: dict[str, Codec]
    model: BaseModel

    def subject(self, impl: str) -> Any:
        return self.model if impl == "pydantic" else self.msg

    def expected(self, impl: str) -> Any:
        """What decoding ``impl``'s encoding of the message must give."""
        if impl == "pydantic":
            return self.model
        v2 = XferMetadataV2 if isinstance(self.msg, XferMetadata) else XferResponseV2
        return v2(*msgspec.structs.astuple(self.msg))


def _request_ids(rng: random.Random) -> tuple[str, str]:
    req_uuid = uuid.UUID(int=rng.getrandbits(128), version=4)
    xfer_uuid = uuid.UUID(int=rng.getrandbits(128), version=4)
    return f"cmpl-{req_uuid}-0", f"xfer-{xfer_uuid}"


def make_pull(num_requests: int) -> XferMetadata:
    """A Qwen3-8B pull (TP=1, 36 layers x K/V) of ``num_requests`` 1000-token prompts, with the
    layout and its ``layout_id``."""
    pull = seed_pull(num_requests, BLOCKS_PER_REQUEST, seed=SEED)
    return msgspec.structs.replace(pull, layout_id=LAYOUT_ID)


def make_response(num_ok: int) -> XferResponse:
    rng = random.Random(SEED)
    return XferResponse(
        status=XferResponseStatus.FINISH,
        ok_reqs=[_request_ids(rng)[0] for _ in range(num_ok)],
    )


_ENCODER: Final = msgspec.msgpack.Encoder()


def _pydantic_codec(model: type[BaseModel]) -> Codec:
    return Codec(lambda m: m.model_dump_json(), model.model_validate_json)


def _pull_workload(name: str, num_requests: int) -> Workload:
    msg = make_pull(num_requests)
    codecs = {
        "pdwire": Codec(pdwire.encode_pull, pdwire.decode_pull),
        "msgspec": Codec(_ENCODER.encode, msgspec.msgpack.Decoder(XferMetadataV2).decode),
        "pydantic": _pydantic_codec(PullModel),
    }
    return Workload(name, msg, codecs, PullModel.model_validate(msgspec.structs.asdict(msg)))


def _response_workload(name: str, num_ok: int) -> Workload:
    msg = make_response(num_ok)
    codecs = {
        "pdwire": Codec(pdwire.encode_response, pdwire.decode_response),
        "msgspec": Codec(_ENCODER.encode, msgspec.msgpack.Decoder(XferResponseV2).decode),
        "pydantic": _pydantic_codec(ResponseModel),
    }
    return Workload(name, msg, codecs, ResponseModel.model_validate(msgspec.structs.asdict(msg)))


WORKLOAD_NAMES: Final = ("pull 1x63", "pull 256x63", "response 256", "response 1")


@functools.cache
def workload(name: str) -> Workload:
    builders: dict[str, Callable[[], Workload]] = {
        "pull 1x63": lambda: _pull_workload(name, 1),
        "pull 256x63": lambda: _pull_workload(name, 256),
        "response 256": lambda: _response_workload(name, 256),
        "response 1": lambda: _response_workload(name, 1),
    }
    return builders[name]()


def check(w: Workload) -> None:
    """Fail loudly if an implementation does not round-trip, or pdwire's bytes differ."""
    for impl in IMPLS:
        codec = w.codecs[impl]
        if codec.decode(codec.encode(w.subject(impl))) != w.expected(impl):
            raise AssertionError(f"{w.name}: {impl} does not round-trip")
    pdwire_codec = w.codecs["pdwire"]
    data = pdwire_codec.encode(w.msg)
    if data != w.codecs["msgspec"].encode(w.msg):
        raise AssertionError(f"{w.name}: pdwire's legacy bytes differ from msgspec's")
    if pdwire_codec.encode(pdwire_codec.decode(data)) != data:
        raise AssertionError(f"{w.name}: pdwire's decode+encode does not give the bytes back")


# -- timing -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    target_s: float
    repeats: int


FULL: Final = Settings(target_s=0.02, repeats=41)
QUICK: Final = Settings(target_s=0.003, repeats=3)


def _timer(w: Workload, impl: str, op: str) -> timeit.Timer:
    codec = w.codecs[impl]
    subject = w.subject(impl)
    namespace = {"enc": codec.encode, "dec": codec.decode, "msg": subject}
    namespace["data"] = codec.encode(subject)
    return timeit.Timer(STMTS[op], globals=namespace)


def _loop_size(timer: timeit.Timer, target_s: float) -> int:
    number = 1
    while True:
        elapsed = timer.timeit(number)
        if elapsed >= target_s:
            return number
        number = max(number + 1, int(number * min(10.0, 1.2 * target_s / max(elapsed, 1e-9))))


@dataclasses.dataclass(frozen=True)
class Timing:
    best_us: dict[str, float]
    ratio: dict[str, float]  # baseline name -> median of the rounds' pdwire/baseline ratios


def time_case(w: Workload, op: str, settings: Settings) -> Timing:
    """Each round times every implementation back to back (order alternating); a round's ratio
    compares neighbours in time, so load from other processes cancels out of the median."""
    timers = {impl: _timer(w, impl, op) for impl in IMPLS}
    numbers = {impl: _loop_size(t, settings.target_s) for impl, t in timers.items()}
    rounds: list[dict[str, float]] = []
    for r in range(settings.repeats):
        per_op = {}
        for impl in IMPLS if r % 2 == 0 else reversed(IMPLS):
            per_op[impl] = timers[impl].timeit(numbers[impl]) / numbers[impl]
        rounds.append(per_op)
    best = {impl: min(r[impl] for r in rounds) * 1e6 for impl in IMPLS}
    ratio = {
        base: statistics.median(r["pdwire"] / r[base] for r in rounds)
        for base in ("msgspec", "pydantic")
    }
    return Timing(best, ratio)


def run_case(w: Workload, op: str, settings: Settings) -> dict[str, Any]:
    t = time_case(w, op, settings)
    return {
        "workload": w.name,
        "op": op,
        "pdwire_us": t.best_us["pdwire"],
        "msgspec_us": t.best_us["msgspec"],
        "ratio_vs_msgspec": t.ratio["msgspec"],
        "pydantic_us": t.best_us["pydantic"],
        "ratio_vs_pydantic": t.ratio["pydantic"],
        "bytes": len(w.codecs["pdwire"].encode(w.msg)),
    }


def run_all(settings: Settings) -> list[dict[str, Any]]:
    total = len(WORKLOAD_NAMES) * len(OPS)
    results: list[dict[str, Any]] = []
    for name in WORKLOAD_NAMES:
        w = workload(name)
        check(w)
        for op in OPS:
            print(f"[{len(results) + 1}/{total}] {name}: {op}", file=sys.stderr, flush=True)
            results.append(run_case(w, op, settings))
    return results


# -- output -----------------------------------------------------------------------------------

COLUMNS: Final = (
    ("workload", 13, "{}"),
    ("op", 14, "{}"),
    ("pdwire us", 11, "{:.2f}"),
    ("msgspec us", 11, "{:.2f}"),
    ("ratio", 7, "{:.3f}"),
    ("pydantic us", 12, "{:.2f}"),
    ("ratio", 7, "{:.3f}"),
    ("bytes", 8, "{}"),
)
KEYS: Final = (
    "workload",
    "op",
    "pdwire_us",
    "msgspec_us",
    "ratio_vs_msgspec",
    "pydantic_us",
    "ratio_vs_pydantic",
    "bytes",
)


def format_table(cases: Sequence[dict[str, Any]]) -> str:
    def row(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, (_, w, _)) in enumerate(zip(cells, COLUMNS, strict=True))
        )

    lines = [row([title for title, _, _ in COLUMNS])]
    lines.append(row(["-" * w for _, w, _ in COLUMNS]))
    for case in cases:
        lines.append(
            row([fmt.format(case[k]) for k, (_, _, fmt) in zip(KEYS, COLUMNS, strict=True)])
        )
    lines.append(
        "us = best per op; ratio = median over rounds of pdwire / baseline timed back to back; "
        "target vs msgspec <= 1.05"
    )
    return "\n".join(lines)


def bench_main(
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    run_all: Callable[[Settings], list[dict[str, Any]]],
    format_table: Callable[[Sequence[dict[str, Any]]], str],
) -> int:
    """The command line every ratio benchmark shares: --quick, --json, a table on stdout."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--quick", action="store_true", help="loops of a few ms and 3 repeats (for tests)"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    cases = run_all(QUICK if args.quick else FULL)
    print(format_table(cases))
    if args.json is not None:
        args.json.write_text(json.dumps({"cases": cases}, indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(
        argv,
        "python -m tests.bench.codec_ratios",
        "Time pdwire's encode/decode of pulls and responses against bare msgspec on the "
        "identical structs and against a pydantic v2 JSON model, and print the ratios. Each case "
        "runs 41 rounds; a round times every implementation back to back over a loop of about "
        "20 ms, and the ratio is the median of the rounds' ratios.",
        run_all,
        format_table,
    )


if __name__ == "__main__":
    sys.exit(main())
