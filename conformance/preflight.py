"""``pdwire conformance preflight``: whether a P and a D can work together, in seconds and before
any completion traffic.

It asks only what P, its bootstrap server and D answer anyway (``/health``, ``/query``,
``/v1/models``) and, where they have it, a pdwire node's ``/pdwire/stats``: an endpoint that is
not there leaves a fact unknown, never makes a problem. Each problem comes with its fix, on one
line: ``PROBLEM: ... FIX: ...``. The exit status is 0 when nothing blocks the pair.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from typing import Any, Final
from urllib.parse import urlsplit

import httpx

from pdwire.errors import DecodeError
from pdwire.http_models import EngineEntry, QueryResponse, decode_json, parse_prefill
from pdwire.messages import Fingerprint, layout_named
from pdwire.negotiation import LEGACY_PEER, Offer, negotiate

from .discovery import Found, found_in
from .peers.http import client

OK, PROBLEM, UNKNOWN = "ok", "PROBLEM", "unknown"
EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
BOOTSTRAP_FIX: Final = (
    "P's bootstrap server listens on VLLM_MOONCAKE_BOOTSTRAP_PORT (default 8998) of P's "
    "TP 0/PP 0 worker's host, or at kv_connector_extra_config.bootstrap_server_address; give "
    "it as --prefill URL@HOST:PORT"
)


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    status: str  # OK, PROBLEM or UNKNOWN
    detail: str
    fix: str = ""

    def line(self) -> str:
        if self.status == PROBLEM:
            return f"PROBLEM: {self.check}: {self.detail} FIX: {self.fix}"
        return f"{self.status + ':':<9}{self.check}: {self.detail}"


@dataclasses.dataclass
class _Got:
    status: int  # 0: no answer
    body: Any
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


async def _get(http: httpx.AsyncClient, url: str) -> _Got:
    try:
        r = await http.get(url)
    except httpx.HTTPError as exc:
        return _Got(0, None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    try:
        body: Any = r.json()
    except ValueError:
        body = r.text
    return _Got(r.status_code, body)


def _why(got: _Got) -> str:
    return f"no answer ({got.error})" if got.status == 0 else f"HTTP {got.status}"


async def _reachable(addr: str, timeout: float) -> str:
    """'' when a TCP connection to ``tcp://host:port`` opens, else why not."""
    parts = urlsplit(addr)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        return str(exc)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), timeout)
    return ""


def _health(who: str, url: str, got: _Got, fix: str) -> Finding:
    if got.ok:
        return Finding(f"{who} health", OK, f"GET {url}/health: 200")
    return Finding(f"{who} health", PROBLEM, f"GET {url}/health: {_why(got)}.", fix)


def _bootstrap(url: str, health: _Got, query: _Got) -> Finding:
    if health.ok:
        return Finding("bootstrap", OK, f"{url} answers /health")
    if query.status == 200:
        return Finding(
            "bootstrap",
            OK,
            f"{url} has no /health ({_why(health)}: a legacy vLLM bootstrap, 4.3-R2); "
            "/query answers",
        )
    return Finding(
        "bootstrap", PROBLEM, f"{url}: /health {_why(health)}, /query {_why(query)}.", BOOTSTRAP_FIX
    )


def _missing(entry: EngineEntry) -> tuple[int, int, list[str]]:
    """P's (TP, PP) sizes as D takes them, and the workers missing from the entry."""
    addrs = entry.worker_addr
    tp = entry.tp_size or max(addrs, default=0) + 1
    pp = entry.pp_size or max((max(by_pp, default=0) + 1 for by_pp in addrs.values()), default=1)
    missing = [f"tp{t}/pp{p}" for t in range(tp) for p in range(pp) if p not in addrs.get(t, {})]
    extra = [f"tp{t}" for t in addrs if t >= tp] + [
        f"tp{t}/pp{p}" for t, by_pp in addrs.items() for p in by_pp if p >= pp
    ]
    return tp, pp, missing + [f"{e} (beyond the sizes)" for e in extra]


def _stats_version(stats: dict[str, Any]) -> int | None:
    """D's wire version where its stats give one (``pdwire_version`` or ``profile``)."""
    version = stats.get("pdwire_version")
    if isinstance(version, int):
        return version
    profile = stats.get("profile")
    if profile in ("legacy", "pdwire/2"):
        return 2 if profile == "pdwire/2" else 1
    return None


def _fingerprint(value: Any) -> Fingerprint | None:
    if not isinstance(value, dict):
        return None
    try:
        return Fingerprint(**value)
    except TypeError:
        return None


def _silent(p: object, d: object, plural: str, singular: str) -> str:
    """The sides whose fact is None, with the verb that agrees: "P and D show", "D shows"."""
    who = " and ".join(w for w, v in (("P", p), ("D", d)) if v is None)
    return f"{who} {plural if p is None and d is None else singular}"


def _models(got: _Got) -> set[str] | None:
    try:
        return {str(m["id"]) for m in got.body["data"]}
    except (KeyError, TypeError):
        return None


@dataclasses.dataclass
class Preflight:
    prefill: str
    bootstrap: str
    decode: str
    decode_tp: int | None = None
    engine_id: str | None = None
    model: str | None = None
    timeout: float = 3.0
    findings: list[Finding] = dataclasses.field(default_factory=list)

    def add(self, check: str, status: str, detail: str, fix: str = "") -> None:
        self.findings.append(Finding(check, status, detail, fix))

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.status == PROBLEM]

    async def run(self) -> list[Finding]:
        async with client(self.timeout) as http:
            urls = (
                f"{self.prefill}/health",
                f"{self.decode}/health",
                f"{self.bootstrap}/health",
                f"{self.bootstrap}/query",
                f"{self.prefill}/v1/models",
                f"{self.decode}/v1/models",
                f"{self.decode}/pdwire/stats",
                f"{self.prefill}/pdwire/stats",
                f"{self.prefill}/metrics",
            )
            got = await asyncio.gather(*(_get(http, u) for u in urls))
        p_health, d_health, b_health, query, p_models, d_models, d_stats, p_stats, metrics = got
        text = metrics.body if metrics.ok and isinstance(metrics.body, str) else ""
        found = found_in(self.prefill, p_models.body, text)
        self.findings.append(
            _health("P", self.prefill, p_health, "start P, or correct --prefill URL")
        )
        self.findings.append(_health("D", self.decode, d_health, "start D, or correct --decode"))
        self.findings.append(_bootstrap(self.bootstrap, b_health, query))
        self._check_roles(p_stats, d_stats)
        self._check_models(p_models, d_models)
        entry = self._check_query(query)
        stats = d_stats.body if d_stats.ok and isinstance(d_stats.body, dict) else {}
        if entry is not None:
            await self._check_workers(entry)
            self._check_versions(entry, stats)
            self._check_fingerprints(entry, stats)
            self._check_pairing(entry, stats)
        self._check_geometry(entry, found)
        p_info = p_stats.body if p_stats.ok and isinstance(p_stats.body, dict) else {}
        self._check_layouts(entry, found, p_info, stats)
        return self.findings

    def _check_roles(self, p: _Got, d: _Got) -> None:
        """A pdwire node says its role in its stats: the two URLs must not be swapped."""
        for who, got, want in (("P", p, "prefill"), ("D", d, "decode")):
            role = got.body.get("role") if got.ok and isinstance(got.body, dict) else None
            if role is not None and role != want:
                flag = "--prefill" if who == "P" else "--decode"
                self.add(
                    "roles",
                    PROBLEM,
                    f"{flag} names a {role} node.",
                    f"give the {want} node's URL as {flag}",
                )

    def _check_models(self, p: _Got, d: _Got) -> None:
        p_ids, d_ids = _models(p), _models(d)
        if p_ids is None or d_ids is None:
            who = "P" if p_ids is None else "D"
            self.add(
                "model",
                UNKNOWN,
                f"{who} names no model on GET /v1/models ({_why(p if p_ids is None else d)})",
            )
            return
        both = p_ids & d_ids
        if self.model is not None and self.model not in both:
            self.add(
                "model",
                PROBLEM,
                f"--model {self.model!r}: P serves {sorted(p_ids)}, D serves {sorted(d_ids)}.",
                "serve that model name on both P and D (vLLM: --served-model-name)",
            )
        elif not both:
            self.add(
                "model",
                PROBLEM,
                f"P serves {sorted(p_ids)}, D serves {sorted(d_ids)}: the proxy sends one model "
                "name to both.",
                "serve the same model under the same name on P and D (vLLM: --served-model-name)",
            )
        else:
            self.add("model", OK, f"both serve {sorted(both)}")

    def _check_query(self, query: _Got) -> EngineEntry | None:
        if not query.ok:
            return None
        try:
            reply = decode_json(
                QueryResponse, query.body if isinstance(query.body, dict) else str(query.body)
            )
        except DecodeError as exc:
            self.add(
                "/query",
                PROBLEM,
                f"{self.bootstrap}/query is not a bootstrap /query reply (§4.2): {exc}.",
                "give P's bootstrap server, not its API, as --prefill URL@BOOTSTRAP",
            )
            return None
        if not reply.root:
            self.add(
                "/query",
                PROBLEM,
                f"{self.bootstrap} has no engine registered.",
                "wait for P's workers to register at start-up; see P's log for "
                "'Failed to register'",
            )
            return None
        chosen = [
            (dp, e) for dp, e in sorted(reply.root.items()) if self.engine_id in (None, e.engine_id)
        ]
        if not chosen:
            known = [e.engine_id for e in reply.root.values()]
            self.add(
                "/query",
                PROBLEM,
                f"no engine {self.engine_id!r} (known: {known}).",
                "pass one of them",
            )
            return None
        for dp, entry in sorted(reply.root.items()):
            tp, pp, missing = _missing(entry)
            name = f"engine {entry.engine_id} (DP {dp})"
            if missing:
                self.add(
                    "P workers",
                    PROBLEM,
                    f"{name}: TP {tp} x PP {pp}, not registered: {', '.join(missing)}.",
                    "wait until every P worker has registered; a D that queries now sizes P "
                    "wrongly for good (vLLM caches the entry: risk 7)",
                )
            else:
                version = f"pdwire/{entry.pdwire_version}" if entry.pdwire_version else "legacy"
                self.add("P workers", OK, f"{name}: TP {tp} x PP {pp}, all registered; {version}")
        return chosen[0][1]

    async def _check_workers(self, entry: EngineEntry) -> None:
        addrs = [(t, p, a) for t, by_pp in entry.worker_addr.items() for p, a in by_pp.items()]
        why = await asyncio.gather(*(_reachable(a, self.timeout) for _, _, a in addrs))
        bad = [f"tp{t}/pp{p} {a} ({w})" for (t, p, a), w in zip(addrs, why, strict=True) if w]
        if bad:
            self.add(
                "side channel",
                PROBLEM,
                f"P workers refuse TCP connections from here: {'; '.join(bad)}.",
                "the worker exited or restarted on a new port (a stale registration: restart "
                "P's bootstrap with P), or registered an address D cannot reach (VLLM_HOST_IP)",
            )
        else:
            self.add("side channel", OK, f"{len(addrs)} P worker(s) accept TCP connections")

    def _check_versions(self, entry: EngineEntry, stats: dict[str, Any]) -> None:
        p_caps = frozenset(entry.pdwire_caps or ())
        p_offer = Offer(entry.pdwire_version, p_caps) if entry.pdwire_version else LEGACY_PEER
        p_text = f"pdwire/{p_offer.version} {sorted(p_caps)}" if entry.pdwire_version else "legacy"
        d_version = _stats_version(stats)
        if d_version is None:
            then = (
                "the pair speaks pdwire/2 if D does, else legacy"
                if entry.pdwire_version
                else "a D learns P is legacy from /query, so the pair speaks legacy"
            )
            self.add("versions", UNKNOWN, f"P speaks {p_text}; D shows no version: {then}")
            return
        d_caps = frozenset(stats.get("pdwire_caps") or ()) if d_version >= 2 else frozenset()
        agreed = negotiate("decode", Offer(d_version, d_caps), p_offer)
        caps = sorted(agreed.caps & p_caps)
        detail = f"P speaks {p_text}, D version {d_version}: pulls go {agreed.profile}"
        self.add("versions", OK, detail + (f", capabilities in use {caps}" if caps else ""))

    def _check_fingerprints(self, entry: EngineEntry, stats: dict[str, Any]) -> None:
        p_fp, d_fp = entry.fingerprint, _fingerprint(stats.get("fingerprint"))
        if p_fp is None or d_fp is None:
            who = _silent(p_fp, d_fp, "show", "shows")
            self.add("fingerprints", UNKNOWN, f"{who} no compatibility fingerprint")
            return
        differ = p_fp.differing_fields(d_fp)
        if differ:
            pairs = ", ".join(f"{f} {getattr(p_fp, f)!r} vs {getattr(d_fp, f)!r}" for f in differ)
            self.add(
                "fingerprints",
                PROBLEM,
                f"P and D differ in {pairs}: KV bytes would mean different things (§9.1).",
                "serve the same model with the same KV dtype, block size and layout on both; "
                "only TP and PP may differ",
            )
        else:
            self.add("fingerprints", OK, "P's and D's are equal")

    def _check_geometry(self, entry: EngineEntry | None, found: Found) -> None:
        """The KV geometry the producer suite takes for P when given none: P's fingerprint, else
        what its model's config.json and its /metrics say (``discovery``)."""
        if entry is not None and entry.fingerprint is not None:
            self.add("geometry", OK, "P's fingerprint gives its KV geometry")
        elif found.geometry is not None:
            self.add("geometry", OK, f"P's KV geometry: {found.describe()}")
        else:
            self.add(
                "geometry",
                UNKNOWN,
                f"P registered no fingerprint and {found.missing}",
                "give the producer suite --layers, --kv-heads, --head-dim and --block-size",
            )

    def _check_layouts(
        self,
        entry: EngineEntry | None,
        found: Found,
        p_stats: dict[str, Any],
        d_stats: dict[str, Any],
    ) -> None:
        """How each side's KV blocks lie (``--kv-layout``): as a pdwire node's stats say, or as
        a pdwire/2 fingerprint names it (§3.6.1), or, for P, as an MLA model's config says. No
        message of the legacy profile carries it, and a mismatch fails every transfer."""
        p_fp = entry.fingerprint if entry is not None else None
        d_fp = _fingerprint(d_stats.get("fingerprint"))
        mla = "mla" if found.geometry is not None and found.geometry.mla else None
        p = p_stats.get("kv_layout") or (p_fp and layout_named(p_fp.kv_layout)) or mla
        d = d_stats.get("kv_layout") or (d_fp and layout_named(d_fp.kv_layout))
        if p is None or d is None:
            self.add(
                "kv layout",
                UNKNOWN,
                f"{_silent(p, d, 'do', 'does')} not say how its KV blocks lie; the producer "
                f"suite assumes {p or 'apart'!r} unless told --kv-layout (together: vLLM's "
                "CPU backend; apart: FlashAttention's)",
            )
        elif p != d:
            self.add(
                "kv layout",
                PROBLEM,
                f"P's KV layout is {p!r}, D's {d!r}: no region pair lines up (§9.1).",
                "start both with the same --kv-layout (the same attention backend)",
            )
        else:
            self.add("kv layout", OK, f"both {p!r}")

    def _check_pairing(self, entry: EngineEntry, stats: dict[str, Any]) -> None:
        p_tp, p_pp, _ = _missing(entry)
        shown = stats.get("tp_size")
        d_tp, source = (
            (shown, "D's /pdwire/stats")
            if isinstance(shown, int)
            else (
                self.decode_tp,
                "--decode-tp",
            )
        )
        if isinstance(shown, int) and self.decode_tp not in (None, shown):
            self.add(
                "TP/PP pairing",
                PROBLEM,
                f"--decode-tp {self.decode_tp}, but D's /pdwire/stats says TP {shown}.",
                "drop --decode-tp, or point --decode at the D meant",
            )
        if d_tp is None:
            self.add(
                "TP/PP pairing",
                UNKNOWN,
                f"P is TP {p_tp} x PP {p_pp}; D's TP size is unknown (pass --decode-tp N)",
            )
            return
        small, large = sorted((p_tp, d_tp))
        if small < 1 or large % small:
            self.add(
                "TP/PP pairing",
                PROBLEM,
                f"P TP {p_tp} and D TP {d_tp}: the larger must be a multiple of the smaller "
                "(10.1.1); D would not pull.",
                "choose TP sizes of which one divides the other",
            )
        else:
            d_pp = stats.get("pp_size")
            pp = f", D PP {d_pp}" if isinstance(d_pp, int) else ""
            self.add("TP/PP pairing", OK, f"P TP {p_tp} x PP {p_pp}, D TP {d_tp}{pp} ({source})")


def _prefill(text: str) -> tuple[str, str]:
    try:
        return parse_prefill(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_prefill_argument(p: argparse.ArgumentParser) -> None:
    """``--prefill URL[@BOOTSTRAP]``, whose value is (P's API, its bootstrap server)."""
    p.add_argument(
        "--prefill",
        required=True,
        type=_prefill,
        metavar="URL[@BOOTSTRAP]",
        help="P's API, and its bootstrap server: a URL, HOST:PORT, a port on P's host, or none "
        "(port 8998 on P's host, the default)",
    )


def add_preflight_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``preflight`` to ``pdwire conformance``'s subcommands."""
    p: argparse.ArgumentParser = sub.add_parser(
        "preflight",
        help="check in seconds, before any traffic, that a P and a D can work together",
        description="Ask P, its bootstrap server and D what they answer anyway (health, /query, "
        "models, and a pdwire node's /pdwire/stats) and name every problem that would block the "
        "pair, each with its fix. Exit status 0 when nothing blocks.",
    )
    add_prefill_argument(p)
    p.add_argument("--decode", required=True, metavar="URL", help="D's API")
    p.add_argument(
        "--decode-tp", type=int, metavar="N", help="D's TP size, when D does not show it"
    )
    p.add_argument("--engine-id", help="the P engine the pair would use (default: DP rank 0's)")
    p.add_argument("--model", help="the model name the proxy would send")
    p.add_argument(
        "--timeout", type=float, default=3.0, metavar="S", help="seconds per request (3)"
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_preflight)
    return p


def cmd_preflight(args: argparse.Namespace) -> int:
    prefill, bootstrap = args.prefill
    check = Preflight(
        prefill,
        bootstrap,
        args.decode.rstrip("/"),
        decode_tp=args.decode_tp,
        engine_id=args.engine_id,
        model=args.model,
        timeout=args.timeout,
    )
    start = time.monotonic()
    findings = asyncio.run(check.run())
    took = time.monotonic() - start
    if args.json:
        doc = {
            "prefill": prefill,
            "bootstrap": bootstrap,
            "decode": check.decode,
            "ok": not check.problems,
            "findings": [dataclasses.asdict(f) for f in findings],
        }
        print(json.dumps(doc, indent=1))
    else:
        print(f"preflight of P {prefill} (bootstrap {bootstrap}) and D {check.decode}")
        for f in findings:
            print(f.line())
        n = len(check.problems)
        print(f"{n} problem(s) in {took:.2f}s" if n else f"nothing blocks the pair ({took:.2f}s)")
    sys.stdout.flush()
    return EXIT_PROBLEM if check.problems else EXIT_OK
