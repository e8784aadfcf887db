"""The pair suite's world: the harness is the client and the proxy of a real P and a real D.

``PairEnv`` is opened once per run: it checks that P, its bootstrap server and D answer, reads
P's engine from ``/query``, and starts the observer (``peers.observer``), whose bootstrap relay
D is sent to. Each case gets a ``PairCtx``: it sends requests as a proxy does (§5.4: a fresh
``transfer_id``, both legs at once with one ``X-Request-Id``), D's local-prefill reference text
(the same body without ``kv_transfer_params``, to D alone), and the observer's view of the side
channel, everything in the case's wire log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import httpx

from ..case import Case, CaseFailed, Suite, Unsupported, WireLog, expect
from ..peers.http import HttpResult, client, request, request_id, transfer_id
from ..peers.observer import HARNESS, REAL, Observer, Problem, Relayed
from ..peers.p_engine import OfPEngine, PEngine, registered_engine
from ..runner import DEFAULT_REQUEST_TIMEOUT, Result, RunOptions, run_suite

#: Prompts of different lengths: shorter than a block, a few blocks, many blocks.
PROMPTS: Final = (
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "Water boils at",
    "Summarise the following text. The history of the printing press begins with movable type "
    "in East Asia and continues with Gutenberg, whose press spread across Europe within fifty "
    "years, lowering the price of books, raising literacy and changing how science, religion "
    "and politics were argued, printed and read by ordinary people in every town and city",
)


@dataclasses.dataclass(frozen=True)
class PairOptions:
    prefill: str  # P's OpenAI API, e.g. http://127.0.0.1:8100
    prefill_bootstrap: str  # P's bootstrap server, e.g. http://127.0.0.1:8998
    decode: str  # D's OpenAI API
    model: str | None = None  # default: the first model of D's /v1/models
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    engine_id: str | None = None  # which engine of P's /query reply (default: DP rank 0's)
    max_tokens: int = 8  # tokens each request decodes
    answer_bound: float = 1.0  # seconds within which D must answer a transfer P will not send
    observer_host: str = "127.0.0.1"  # where the observer listens: D must reach it


@dataclasses.dataclass
class Answer:
    """One completion answer, whole or streamed."""

    status: int  # 0: no response
    text: str
    body: Any  # the JSON body, or the list of stream events
    elapsed: float
    done_at: float  # monotonic, when the answer was complete
    error: str = ""
    params: Any = None  # kv_transfer_params as answered
    has_params: bool = False  # the key was there
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids, when the server gives them

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def describe(self) -> str:
        if self.status == 0:
            return f"no response ({self.error})"
        if not self.ok:
            return f"HTTP {self.status} {self.error or _short(self.body)}"
        return f"HTTP 200 {self.text!r}"

    @property
    def prompt_tokens(self) -> int | None:
        n = (self.usage or {}).get("prompt_tokens")
        return n if isinstance(n, int) else None


@dataclasses.dataclass(frozen=True)
class Legs:
    """The P leg and the D leg of one client request, as the proxy sends them."""

    transfer_id: str
    request_id: str
    view: str
    body: dict[str, Any]  # the client's
    p_leg: dict[str, Any]
    d_leg: dict[str, Any]
    p_headers: dict[str, str]
    d_headers: dict[str, str]


@dataclasses.dataclass
class Exchange:
    """One client request sent through the harness as proxy."""

    transfer_id: str
    request_id: str
    view: str
    body: dict[str, Any]
    p: Answer
    d: Answer
    started: float  # monotonic, when both legs were sent


def _short(body: Any, limit: int = 300) -> str:
    text = body if isinstance(body, str) else json.dumps(body)
    return text if len(text) <= limit else text[:limit] + "..."


def _choice(body: Any) -> dict[str, Any]:
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        return {}
    return choice if isinstance(choice, dict) else {}


def _from_http(got: HttpResult) -> Answer:
    body = got.body if isinstance(got.body, dict) else {}
    choice = _choice(body)
    ids = choice.get("token_ids")
    return Answer(
        got.status,
        got.text(),
        got.body,
        got.elapsed,
        time.monotonic(),
        error=got.error,
        params=body.get("kv_transfer_params"),
        has_params="kv_transfer_params" in body,
        usage=body.get("usage") if isinstance(body.get("usage"), dict) else None,
        finish_reason=choice.get("finish_reason"),
        token_ids=list(ids) if isinstance(ids, list) else None,
    )


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    log: WireLog,
    timeout: float,
) -> Answer:
    """POST a streaming completion; the text is every chunk's text or delta, in order."""
    channel = f"http POST {url} (stream)"
    log.sent(channel, "request", body)
    start = time.monotonic()
    events: list[Any] = []
    answer = Answer(0, "", events, 0.0, 0.0)
    parts: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
            answer.status = r.status_code
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                try:
                    answer.body = json.loads(raw)
                except ValueError:
                    answer.body = raw
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    events.append(event)
                    _take_event(answer, event, parts)
    except (httpx.HTTPError, ValueError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.text = "".join(parts)
    answer.elapsed = time.monotonic() - start
    answer.done_at = time.monotonic()
    log.received(
        channel, f"HTTP {answer.status}{' ' + answer.error if answer.error else ''}", answer.body
    )
    return answer


def _take_event(answer: Answer, event: Any, parts: list[str]) -> None:
    if not isinstance(event, dict):
        return
    if "error" in event:
        answer.error = f"error event: {_short(event['error'])}"
        return
    choice = _choice(event)
    if "text" in choice:
        parts.append(str(choice["text"] or ""))
    elif isinstance(choice.get("delta"), dict):
        parts.append(str(choice["delta"].get("content") or ""))
    if choice.get("finish_reason"):
        answer.finish_reason = choice["finish_reason"]
    if isinstance(choice.get("token_ids"), list):
        answer.token_ids = (answer.token_ids or []) + list(choice["token_ids"])
    if "kv_transfer_params" in event:
        answer.params, answer.has_params = event["kv_transfer_params"], True
    if isinstance(event.get("usage"), dict):
        answer.usage = event["usage"]


class PairEnv(OfPEngine):
    """What every pair case shares: the addresses, P's engine, the observer, D's local texts."""

    def __init__(self, options: PairOptions) -> None:
        self.options = options
        self.http = client(options.request_timeout)
        self.observer = Observer(
            options.prefill_bootstrap, host=options.observer_host, timeout=options.request_timeout
        )
        self.p = PEngine({}, 0, {})
        self.model = options.model or ""
        self.local_cache: dict[str, Answer] = {}
        self.views = itertools.count(1)

    async def open(self) -> None:
        o, log = self.options, WireLog()
        for name, url in (("P", o.prefill), ("D", o.decode)):
            got = await request(self.http, "GET", f"{url}/health", log)
            if got.status != 200:
                raise RuntimeError(
                    f"{name} at {url} does not answer GET /health with 200 "
                    f"(HTTP {got.status} {got.error or _short(got.body)}): is it up?"
                )
        picked = await registered_engine(
            self.http, o.prefill_bootstrap, o.engine_id, log, o.request_timeout
        )
        if isinstance(picked, str):
            raise RuntimeError(picked)
        self.p = picked
        if not self.engine_id:
            raise RuntimeError(f"P's engine at {o.prefill_bootstrap} has no engine_id")
        if not self.model:
            models = await request(self.http, "GET", f"{o.decode}/v1/models", log)
            try:
                self.model = str(models.body["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise RuntimeError(f"GET {o.decode}/v1/models named no model") from None
        await self.observer.start()

    async def close(self) -> None:
        unanswered = await self.observer.close()
        await self.http.aclose()
        if unanswered:
            print(
                f"pdwire conformance: {unanswered} message(s) of D's still had no answer from P "
                f"{self.options.request_timeout:g}s after the last case; the relay is gone, so D "
                "holds their blocks until its receive timeout",
                file=sys.stderr,
            )

    async def serving(self) -> str | None:
        """Whether the pair still serves (``runner.Probe``): a plain request, sent as the proxy
        sends it, is answered by both."""
        t = PairCtx(self, WireLog())
        x = await t.exchange(t.body(PROMPTS[0]))
        if x.p.ok and x.d.ok:
            return None
        return f"a plain request failed: P {x.p.describe()}; D {x.d.describe()}"

    @property
    def block_size(self) -> int | None:
        fp = self.entry.get("fingerprint")
        size = fp.get("block_size") if isinstance(fp, dict) else None
        return size if isinstance(size, int) else None


class PairCtx:
    """One pair case's view of the world."""

    def __init__(self, env: PairEnv, log: WireLog) -> None:
        self.env = env
        self.log = log
        self.options = env.options
        self.observer = env.observer
        self.observer.begin(log)

    # -- requests ----------------------------------------------------------------------------

    def body(
        self,
        prompt: str,
        *,
        chat: bool = False,
        stream: bool = False,
        max_tokens: int | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """A client's greedy completion request."""
        body: dict[str, Any] = {"model": self.env.model}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body.update(
            max_tokens=max_tokens or self.options.max_tokens, temperature=0, stream=stream, **extra
        )
        return body

    def _url(self, base: str, body: dict[str, Any]) -> str:
        return f"{base}/v1/chat/completions" if "messages" in body else f"{base}/v1/completions"

    async def _post(self, base: str, body: dict[str, Any], headers: dict[str, str]) -> Answer:
        url, timeout = self._url(base, body), self.options.request_timeout
        if body.get("stream"):
            return await _stream(self.env.http, url, body, headers, self.log, timeout)
        got = await request(self.env.http, "POST", url, self.log, body=body, headers=headers)
        return _from_http(got)

    def legs(
        self,
        body: dict[str, Any],
        *,
        view: str = REAL,
        p_body: dict[str, Any] | None = None,
        d_params: dict[str, Any] | None = None,
    ) -> Legs:
        """The two legs a proxy makes of ``body`` (§5.4): the P leg (of ``p_body`` when given)
        and the D leg (with ``d_params`` added), D pointed at the observer's relay for
        ``view``."""
        tid, rid = transfer_id(), request_id()
        p_leg = {k: v for k, v in (p_body or body).items() if k != "stream_options"}
        p_leg.update(max_tokens=1, stream=False)
        if "max_completion_tokens" in p_leg:
            p_leg["max_completion_tokens"] = 1
        p_leg["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": tid,
        }
        d_leg = dict(body)
        d_leg["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_bootstrap_addr": self.observer.url(view),
            "remote_engine_id": self.observer.engine_id(self.env.engine_id, view),
            "transfer_id": tid,
            **(d_params or {}),
        }
        headers = {"X-Request-Id": rid}
        p_headers = {**headers, "X-data-parallel-rank": str(self.env.dp_rank)}
        self.log.note(f"request {rid}: transfer {tid} ({view} view)")
        return Legs(tid, rid, view, body, p_leg, d_leg, p_headers, headers)

    async def send_p(self, legs: Legs) -> Answer:
        return await self._post(self.options.prefill, legs.p_leg, legs.p_headers)

    async def send_d(self, legs: Legs) -> Answer:
        return await self._post(self.options.decode, legs.d_leg, legs.d_headers)

    async def exchange(
        self,
        body: dict[str, Any],
        *,
        view: str = REAL,
        p_body: dict[str, Any] | None = None,
    ) -> Exchange:
        """Send ``body`` as the proxy does: both legs at the same time (5.4-R7)."""
        legs = self.legs(body, view=view, p_body=p_body)
        started = time.monotonic()
        p, d = await asyncio.gather(self.send_p(legs), self.send_d(legs))
        return Exchange(legs.transfer_id, legs.request_id, view, body, p, d, started)

    async def local(self, body: dict[str, Any]) -> Answer:
        """D's own text for ``body``: the same request without kv_transfer_params, to D alone
        (once per body and run: greedy decoding is deterministic)."""
        key = json.dumps(body, sort_keys=True)
        cached = self.env.local_cache.get(key)
        if cached is not None:
            self.log.note("D's local-prefill answer (measured earlier in this run)", cached.text)
            return cached
        answer = await self._post(self.options.decode, body, {"X-Request-Id": request_id()})
        if 400 <= answer.status < 500:  # e.g. a chat request to a model without a chat template
            raise Unsupported(
                f"D refuses the request on its own too ({answer.describe()}): a limit of the "
                "testee, not of the protocol"
            )
        expect(answer.ok, f"D's local prefill of the same request failed: {answer.describe()}")
        self.env.local_cache[key] = answer
        return answer

    async def compare(self, body: dict[str, Any], *, view: str = REAL) -> tuple[Exchange, Answer]:
        x = await self.exchange(body, view=view)
        return x, await self.local(body)

    async def new_view(self, *, legacy: bool = False) -> str:
        """A view of P that D has not seen yet: new relay, engine id and worker endpoints;
        ``legacy``: as a legacy bootstrap server shows P (no pdwire/2 field)."""
        name = f"{'legacy' if legacy else 'fresh'}-{next(self.env.views)}"
        await self.observer.add_view(name, legacy=legacy)
        return name

    # -- checks ------------------------------------------------------------------------------

    def expect_served(self, x: Exchange) -> None:
        """Both legs answered HTTP 200."""
        expect(x.p.ok, f"P's leg failed: {x.p.describe()}")
        expect(x.d.ok, f"D's leg failed: {x.d.describe()} (transfer {x.transfer_id})")

    def expect_same_text(self, x: Exchange, local: Answer) -> None:
        """An HTTP 200 whose text differs from D's local prefill is a failure."""
        self.expect_served(x)
        expect(
            x.d.text == local.text,
            f"D answered HTTP 200 with {x.d.text!r} for transfer {x.transfer_id}, but its own "
            f"local prefill of the same request gives {local.text!r}: the KV it decoded from is "
            "not the prompt's",
            expected=local.text,
            actual=x.d.text,
        )

    def pulls(self, x: Exchange) -> list[tuple[Relayed, str]]:
        return self.observer.pulls_for(x.transfer_id)

    def expect_pulled(self, x: Exchange) -> list[tuple[Relayed, str]]:
        """D pulled at least once for the transfer: it did not recompute the prompt silently."""
        found = self.pulls(x)
        queried = f"D queried the relay {len(self.observer.queries)} time(s){self._refusals()}"
        expect(
            bool(found),
            f"D answered {x.d.describe()} for transfer {x.transfer_id} without any pull for it "
            f"({queried}): it recomputed the prompt instead of loading P's KV",
        )
        return found

    def expect_clean(self, *requirements: str) -> None:
        """The observer found no problem with any of ``requirements`` in this case."""
        found = self.observer.problems_of(HARNESS, *requirements)
        if found:
            raise CaseFailed(_problems(found))

    def require_traffic(self) -> None:
        if not any(r.kind == "pull" for r in self.observer.records):
            raise CaseFailed(
                "no pull passed the observer: D did not load any request from P (see pair/5.2/4)"
                + self._refusals()
            )

    def expect_pulled_and_served(self, exchanges: Sequence[Exchange]) -> None:
        """Some pull passed the observer, and both legs of each of ``exchanges`` were served. A
        case checks this before it finds what D announced unsupported: a D that never reached P
        (its bootstrap query failed, say) announced nothing, and that is a failure."""
        self.require_traffic()
        for x in exchanges:
            self.expect_served(x)

    def _refusals(self) -> str:
        """What the relay answered D's failed queries, if any did fail."""
        refused = "; ".join(self.observer.refused)
        return f"; the relay answered D's query with {refused}" if refused else ""

    async def p_stats(self) -> dict[str, Any] | None:
        """P's ``GET /pdwire/stats`` (a pdwire node's), or None when P has no such route."""
        got = await request(self.env.http, "GET", f"{self.options.prefill}/pdwire/stats", self.log)
        return got.body if got.ok and isinstance(got.body, dict) else None


def _problems(found: Sequence[Problem]) -> str:
    lines = [f"{p.detail} (spec {p.requirement})" for p in found[:6]]
    more = f"; and {len(found) - 6} more" if len(found) > 6 else ""
    return "; ".join(lines) + more


async def run_pair(
    options: PairOptions,
    cases: Sequence[Case],
    run_options: RunOptions,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    env = PairEnv(options)
    return await run_suite(
        env, Suite.PAIR, lambda log: PairCtx(env, log), cases, run_options, on_result
    )
