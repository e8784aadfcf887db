"""The harness's own machinery, without a testee: the requirement catalogue, case registration,
verdicts, known-failing and known-flaky lists, reports and the traceability table."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from conformance import case as case_module
from conformance import cli, runner, traceability
from conformance.case import (
    Case,
    Skip,
    Suite,
    Unsupported,
    Verdict,
    WireLog,
    all_cases,
    case,
    expect,
)
from conformance.report import write_html, write_json, write_junit
from conformance.requirements import (
    CATALOGUE,
    PROFILES,
    ROLES,
    Level,
    catalogue,
    dump,
    get,
    parse,
    parse_spec,
)
from conformance.runner import (
    RunOptions,
    exit_code,
    read_list,
    run_case,
    scale_for,
    select,
    summary,
)
from conformance.selftest import DEFAULT, KEYED, Layout, by_layout
from conformance.traceability import UNCOVERED
from mutants import MUTANTS, Mutant
from mutants.check import cases_of, work_items


def test_catalogue_is_the_spec() -> None:
    """requirements.json is what spec/ says (pdwire conformance requirements --write)."""
    assert CATALOGUE.read_text(encoding="utf-8") == dump(parse_spec())


def test_parse_takes_id_level_text_and_tag() -> None:
    md = (
        "- **3.9-R1** *[P, D; both]* A sender MUST NOT do this,\n  across two lines.\n"
        "- **3.9-R2** *[D, proxy, bootstrap; legacy]* A receiver SHOULD do that.\n\n"
        "- **10.99.1** *[P; pdwire/2]* P MAY do so.\n"
        "- **3.9-R3** *Withdrawn in revision 9: no keyword here.*\n"
    )
    reqs = parse(md)
    assert [(r.id, r.section, r.level, r.roles, r.profile, r.pdwire2) for r in reqs] == [
        ("3.9-R1", "3.9", Level.MUST, ("P", "D"), "both", False),
        ("3.9-R2", "3.9", Level.SHOULD, ("D", "proxy", "bootstrap"), "legacy", False),
        ("10.99.1", "10.99", Level.MAY, ("P",), "pdwire/2", True),
    ]
    assert reqs[0].text == "A sender MUST NOT do this, across two lines."
    assert reqs[2].text == "P MAY do so."


@pytest.mark.parametrize(
    ("bullet", "error"),
    [
        ("- **3.9-R4** P MUST do this.", r"3\.9-R4 has no tag"),
        ("- **10.99.2** *(pdwire/2)* P MUST do this.", r"10\.99\.2 has no tag"),
        ("- **3.9-R4** *[D, P; both]* P MUST do this.", r"3\.9-R4: roles 'D, P'"),
        ("- **3.9-R4** *[P, P; both]* P MUST do this.", r"3\.9-R4: roles 'P, P'"),
        ("- **3.9-R4** *[P,D; both]* P MUST do this.", r"3\.9-R4: roles 'P,D'"),
        ("- **3.9-R4** *[client; both]* P MUST do this.", r"3\.9-R4: roles 'client'"),
        ("- **3.9-R4** *[P; pdwire2]* P MUST do this.", r"3\.9-R4: profile 'pdwire2'"),
    ],
)
def test_a_requirement_without_a_valid_tag_is_an_error(bullet: str, error: str) -> None:
    """A new requirement that lacks its tag fails the parse, and so the drift test."""
    with pytest.raises(ValueError, match=error):
        parse(bullet + "\n")


def test_every_requirement_binds_some_role_in_one_profile() -> None:
    for r in catalogue().values():
        assert r.roles and r.profile in PROFILES, r.id
        assert list(r.roles) == sorted(set(r.roles), key=ROLES.index), r.id


async def _noop(ctx: Any) -> None:
    return None


def test_case_ids_must_match_their_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(case_module, "REGISTRY", {})
    with pytest.raises(ValueError, match="is not <producer"):
        case("nonsense/3.2/1", "3.2-R1")
    with pytest.raises(ValueError, match=r"its requirement 3\.2-R1 in 3\.2"):
        case("producer/3.4/1", "3.2-R1")
    with pytest.raises(KeyError, match="no requirement"):
        case("producer/3.2/1", "3.2-R99")
    case("producer/3.2/1", "3.2-R1", covers=("3.2-R3",))(_noop)
    with pytest.raises(ValueError, match="defined twice"):
        case("producer/3.2/1", "3.2-R1")(_noop)
    registered = case_module.REGISTRY["producer/3.2/1"]
    assert registered.covers == ("3.2-R1", "3.2-R3")
    assert registered.suite is Suite.PRODUCER and registered.level is Level.MUST


def _case(req: str, func: Callable[[Any], Awaitable[None]], timeout: float = 1.0) -> Case:
    r = get(req)
    return Case(f"producer/{r.section}/1", Suite.PRODUCER, r, (r.id,), "t", timeout, func)


async def _fails(ctx: Any) -> None:
    expect(False, "seen wrong")


async def _hangs(ctx: Any) -> None:
    await asyncio.Event().wait()


async def _unsupported(ctx: Any) -> None:
    raise Unsupported("no such capability")


async def _skips(ctx: Any) -> None:
    raise Skip("no timer value")


async def _raises(ctx: Any) -> None:
    raise ConnectionResetError("peer gone")


MUST, SHOULD, MAY = "3.2-R1", "3.2-R9", "10.7.7"


@pytest.mark.parametrize(
    ("req", "func", "strict", "verdict", "detail"),
    [
        (MUST, _noop, False, Verdict.PASS, ""),
        (MUST, _fails, False, Verdict.FAIL, "seen wrong"),
        (SHOULD, _fails, False, Verdict.NON_STRICT, "seen wrong"),
        (SHOULD, _fails, True, Verdict.FAIL, "seen wrong"),
        (MAY, _fails, True, Verdict.INFORMATIONAL, "seen wrong"),
        (MUST, _hangs, False, Verdict.FAIL, "timed out after 0.1s"),
        (MUST, _unsupported, False, Verdict.UNSUPPORTED, "no such capability"),
        (MUST, _skips, False, Verdict.SKIPPED, "no timer value"),
        (MUST, _raises, False, Verdict.FAIL, "ConnectionResetError: peer gone"),
    ],
)
def test_verdicts(
    req: str, func: Callable[[Any], Awaitable[None]], strict: bool, verdict: Verdict, detail: str
) -> None:
    c = _case(req, func, timeout=0.1)
    result = asyncio.run(run_case(c, lambda log: None, RunOptions(strict=strict)))
    assert result.verdict is verdict
    assert detail in result.detail
    assert result.unexpected is (verdict is Verdict.FAIL)


async def _answers_in_a_third_of_a_second(ctx: Any) -> None:
    await asyncio.sleep(0.3)


def test_longer_waits_give_a_case_a_longer_bound() -> None:
    """``--timeout`` above the default stretches every case's bound in proportion, so a slow
    testee given long waits is not cut off by a bound sized for the default; it never shrinks."""
    from pdwire.cli import build_parser

    slow = _case(MUST, _answers_in_a_third_of_a_second, timeout=0.1)
    assert asyncio.run(run_case(slow, lambda log: None, RunOptions())).verdict is Verdict.FAIL
    stretched = RunOptions(timeout_scale=scale_for(60.0))
    assert asyncio.run(run_case(slow, lambda log: None, stretched)).verdict is Verdict.PASS
    parser = build_parser()
    for given, scale in (([], 1.0), (["--timeout", "3"], 1.0), (["--timeout", "60"], 6.0)):
        pair = ["conformance", "pair", "--prefill", "http://p:8100", "--decode", "http://d:8200"]
        args = parser.parse_args([*pair, *given])
        assert cli.run_options(args).timeout_scale == scale


def test_known_failing_and_flaky() -> None:
    failing, passing = _case(MUST, _fails), _case(MUST, _noop)
    known = RunOptions(known_failing=frozenset({"producer/3.2/*"}))
    r_fail = asyncio.run(run_case(failing, lambda log: None, known))
    r_pass = asyncio.run(run_case(passing, lambda log: None, known))
    assert r_fail.verdict is Verdict.FAIL and not r_fail.unexpected
    assert r_pass.verdict is Verdict.PASS and r_pass.unexpected  # the list is stale
    assert exit_code([r_fail]) == 0 and exit_code([r_fail, r_pass]) == 1
    flaky = RunOptions(known_flaky=frozenset({"producer/3.2/1"}))
    r_flaky = asyncio.run(run_case(failing, lambda log: None, flaky))
    assert r_flaky.verdict is Verdict.FAIL and not r_flaky.unexpected


def _stalls_then_fails(runs: list[int], stall: float, passes_on: int = 2) -> Callable[[Any], Any]:
    """A case that blocks the loop for ``stall`` seconds (as a machine that stopped does) and
    fails, until its run ``passes_on``."""

    async def func(ctx: Any) -> None:
        runs.append(1)
        time.sleep(stall)  # the stall: the loop cannot run
        await asyncio.sleep(0)
        expect(len(runs) >= passes_on, f"failed in run {len(runs)}")

    return func


def test_a_case_that_failed_while_the_loop_stalled_runs_once_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "STALL_S", 0.2)
    runs: list[int] = []
    result = asyncio.run(run_case(_case(MUST, _stalls_then_fails(runs, 0.3)), _no_ctx, OPTS))
    assert len(runs) == 2 and result.verdict is Verdict.PASS
    assert result.detail.startswith("run a second time: the harness's loop stalled 0.")
    assert result.detail.endswith("which failed: failed in run 1")
    # failing again, it fails with both runs' details
    runs.clear()
    again = _case(MUST, _stalls_then_fails(runs, 0.3, passes_on=3))
    result = asyncio.run(run_case(again, _no_ctx, OPTS))
    assert len(runs) == 2 and result.verdict is Verdict.FAIL
    assert result.detail.endswith("which failed: failed in run 1\nfailed in run 2")


def test_no_second_run_without_a_stall_or_for_a_case_that_may_break_its_testee(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "STALL_S", 0.2)
    runs: list[int] = []
    short = _case(MUST, _stalls_then_fails(runs, 0.0))
    assert asyncio.run(run_case(short, _no_ctx, OPTS)).verdict is Verdict.FAIL and runs == [1]
    runs.clear()
    breaking = dataclasses.replace(_case(MUST, _stalls_then_fails(runs, 0.3)), breaks_testee=True)
    assert asyncio.run(run_case(breaking, _no_ctx, OPTS)).verdict is Verdict.FAIL and runs == [1]


def _no_ctx(log: WireLog) -> None:
    return None


OPTS = RunOptions()


def test_lists_and_globs(tmp_path: Path) -> None:
    path = tmp_path / "known.txt"
    path.write_text("producer/3.2/1  # the reason\n\n# a comment\nconsumer/*\n")
    assert read_list(path) == {"producer/3.2/1", "consumer/*"}
    cs = [_case(MUST, _noop), _case("3.4-R1", _noop)]
    assert [c.id for c in select(cs, ["producer/3.4/*"])] == ["producer/3.4/1"]
    assert len(select(cs, None)) == 2 and len(select(cs, ["producer/3.2/1,producer/3.4/1"])) == 2


def test_reports(tmp_path: Path) -> None:
    results = [
        asyncio.run(run_case(_case(MUST, f), lambda log: None, RunOptions()))
        for f in (_noop, _fails, _skips)
    ]
    results[1].log.sent("zmq tcp://127.0.0.1:1", "a pull", {"req_blocks": {}})
    testee = {"role": "producer", "api": "http://127.0.0.1:1"}
    write_json(tmp_path / "r.json", results, testee)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["summary"] == summary(results) and doc["summary"]["fail"] == 1
    keys = {"id", "section", "level", "verdict", "requirement", "duration_s", "detail"}
    assert all(keys <= set(c) for c in doc["cases"])
    assert doc["cases"][1]["wirelog"][0]["what"] == "a pull"
    write_junit(tmp_path / "r.xml", results, testee)
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "3" and suite.get("failures") == "1"
    assert suite.get("skipped") == "1"
    write_html(tmp_path / "r.html", results, testee)
    page = (tmp_path / "r.html").read_text()
    assert "seen wrong" in page and "a pull" in page
    assert "<script src" not in page and "<link" not in page  # one self-contained file


def test_traceability_table_lists_every_requirement() -> None:
    rows = traceability.table([_case(MUST, _noop)])
    assert len(rows) == len(parse_spec())
    covered = [r for r in rows if r.covered]
    assert [r.requirement.id for r in covered] == [MUST]
    assert MUST not in {r.id for r in traceability.uncovered_musts(rows)}
    assert "| 3.2-R1 | MUST | `producer/3.2/1` |" in traceability.markdown(rows)


def test_trace_counts_requirements_by_profile_and_by_role() -> None:
    """A requirement counts once for its profile and once for each role it binds."""
    req = get(MUST)
    counts = traceability.counts([_case(MUST, _noop)])
    reqs = parse_spec()
    assert counts["requirements_by_profile"] == {
        p: sum(r.profile == p for r in reqs) for p in PROFILES
    }
    assert counts["requirements_by_role"] == {o: sum(o in r.roles for r in reqs) for o in ROLES}
    assert counts["requirements_covered_by_profile"] == {p: int(p == req.profile) for p in PROFILES}
    assert counts["requirements_covered_by_role"] == {o: int(o in req.roles) for o in ROLES}


def test_trace_prints_the_counts_by_profile_and_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trace", "--json"]) == cli.EXIT_OK
    counts = json.loads(capsys.readouterr().out)
    assert sum(counts["requirements_by_profile"].values()) == len(parse_spec())
    assert cli.main(["trace"]) == cli.EXIT_OK
    out = capsys.readouterr().out.splitlines()
    got = counts["requirements_covered_by_role"]["D"]
    assert f"role D: {got} of {counts['requirements_by_role']['D']} covered" in out
    assert any(line.startswith("profile pdwire/2: ") for line in out)


def test_every_must_has_a_case_or_a_reason() -> None:
    """The spec's every MUST is covered by a case, or UNCOVERED says why no case can observe
    it; an entry of UNCOVERED that a case covers, or that is no MUST, is stale."""
    rows = traceability.table()
    missing = [r.id for r in traceability.uncovered_musts(rows) if r.id not in UNCOVERED]
    assert not missing, f"MUSTs without a case: {missing}"
    musts = {r.requirement.id for r in rows if r.requirement.level is Level.MUST}
    covered = {r.requirement.id for r in rows if r.covered}
    stale = sorted(i for i in UNCOVERED if i in covered or i not in musts)
    assert not stale, f"UNCOVERED names requirements that have cases or are no MUST: {stale}"
    assert all(reason.strip() for reason in UNCOVERED.values())


def test_a_must_without_a_case_is_found() -> None:
    """A MUST whose only case is gone shows among the uncovered, which the test above fails
    on."""
    rows = traceability.table([c for c in all_cases() if "3.2-R4" not in c.covers])
    assert "3.2-R4" in {r.id for r in traceability.uncovered_musts(rows)}
    assert "3.2-R4" not in UNCOVERED


def test_the_mutants_of_one_special_layout_are_one_work_item() -> None:
    """The mutants whose cases need the same testees other than the default ones are one item,
    which one checker takes whole (so one checker starts those testees); every other mutant
    is an item of its own; each mutant is in one item, and the items of several come first."""
    cases = all_cases()
    chosen = list(MUTANTS.values())
    items = work_items(chosen, cases)
    assert sorted(m.name for item in items for m in item) == sorted(MUTANTS)

    def layouts(m: Mutant) -> frozenset[Layout]:
        return frozenset(by_layout(cases_of(m, cases)))

    several = [item for item in items if len(item) > 1]
    assert several and items[: len(several)] == several
    assert [len(i) for i in several] == sorted((len(i) for i in several), reverse=True)
    special = [layouts(item[0]) for item in several]
    assert len(set(special)) == len(special) and all(s - {DEFAULT} for s in special)
    for item in several:
        assert all(m.role != "proxy" and layouts(m) == layouts(item[0]) for m in item)
    keyed = {m.name for m in chosen if layouts(m) == {KEYED}}
    assert len(keyed) > 1 and {m.name for m in items[special.index(frozenset({KEYED}))]} == keyed
    assert work_items([], cases) == []


def test_each_case_runs_in_the_layout_it_needs() -> None:
    """Every case ``selftest.LAYOUTS`` names exists; the rest run in the default layout, the
    authentication cases in the keyed one; the default layout's cases come first."""
    from conformance import selftest

    registered = {c.id: c for c in all_cases()}
    assert set(selftest.LAYOUTS) <= set(registered)
    groups = selftest.by_layout(all_cases())
    assert next(iter(groups)) == selftest.DEFAULT
    for layout, cases in groups.items():
        for c in cases:
            if c.id in selftest.LAYOUTS:
                assert layout == selftest.LAYOUTS[c.id]
            else:
                auth = c.section == selftest.AUTH_SECTION
                assert layout == (selftest.KEYED if auth else selftest.DEFAULT)
    pp, tp = selftest.LAYOUTS["producer/10.2/3"], selftest.LAYOUTS["consumer/10.1/2"]
    assert pp.prefill_pp >= 2 and tp.decode_tp >= 2


def test_layouts_run_alone_and_the_timer_layouts_together_last() -> None:
    """``selftest.stages``: DEFAULT's layout alone first, each other layout alone, then the
    lease and slow-prefill layouts together; no layout twice or missing."""
    from conformance import selftest

    order = selftest.stages(selftest.by_layout(all_cases()))
    assert order[0] == [selftest.DEFAULT]
    assert set(order[-1]) == set(selftest.LAST) and len(order[-1]) == len(selftest.LAST)
    assert all(len(stage) == 1 and stage[0] not in selftest.LAST for stage in order[:-1])
    flat = [layout for stage in order for layout in stage]
    assert sorted(map(str, flat)) == sorted(map(str, selftest.by_layout(all_cases())))


def test_a_stage_whose_layout_fails_to_start_stops_the_testbeds_that_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When one layout of the last stage fails to start, the other's testbed, which started, is
    stopped and the failure is raised. The start is faked: a node that fails to start beside
    one that starts cannot be caused on purpose here."""
    from conformance import selftest

    stopped: list[Layout] = []
    lease, slow = selftest.LEASED, selftest.SLOW_PREFILL

    class Bed(selftest.Testbed):
        async def stop(self) -> None:
            stopped.append(self.layout)

    async def started(layout: Layout, roles: set[str]) -> selftest.Testbed:
        if layout == slow:
            await asyncio.sleep(0.05)  # the lease layout has started by then
            raise RuntimeError("the slow-prefill P did not start")
        return Bed(layout)

    monkeypatch.setattr(selftest, "_started", started)
    cases = [c for c in all_cases() if selftest.layout_of(c) in (lease, slow)]
    with pytest.raises(RuntimeError, match="did not start"):
        asyncio.run(selftest._run_layouts(cases, runner.RunOptions(), None, 1.0))
    assert stopped == [lease]


def test_a_free_port_is_never_given_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``free_port`` calls (a node's API and its bootstrap server) never get the same port,
    though the first was not bound yet when the second came: with every pick the same port,
    the second gets another."""
    from conformance import ports

    first = ports.free_port()
    monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: first)
    assert ports.free_port() != first


def test_a_fake_peer_never_takes_an_address_one_had_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bind_fresh`` gives each socket a port no socket of the process had, even once the
    earlier ones closed, so a testee's memory of an address never meets a new peer; a port
    another socket holds is skipped."""
    import zmq

    from conformance import ports

    ctx = zmq.Context()
    try:
        seen: list[int] = []
        for _ in range(20):
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            seen.append(ports.bind_fresh(sock, "127.0.0.1"))
            sock.close()
        assert len(set(seen)) == len(seen)
        assert all(ports.PEER_RANGE[0] <= p < ports.PEER_RANGE[1] for p in seen)
        holder = ctx.socket(zmq.ROUTER)
        held = holder.bind_to_random_port("tcp://127.0.0.1", *ports.PEER_RANGE)
        planned, real = [seen[0], held], ports.random.randrange
        monkeypatch.setattr(
            ports.random, "randrange", lambda lo, hi: planned.pop(0) if planned else real(lo, hi)
        )
        sock = ctx.socket(zmq.ROUTER)
        got = ports.bind_fresh(sock, "127.0.0.1")
        assert got not in (seen[0], held)
        sock.close()
        holder.close()
    finally:
        ctx.term()


def test_a_bad_d_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["consumer", "--api", "http://127.0.0.1:9", "--d-command", "pdwire node --port {nope}"]
    assert cli.main(args) == cli.EXIT_USAGE
    assert "{port}" in capsys.readouterr().err


def test_matrix_manifest_gate_must_be_a_pair_case(tmp_path: Path) -> None:
    from conformance.matrix import ManifestError, load_manifest

    doc = json.loads(Path(cli.__file__).with_name("matrix.example.json").read_text())
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**doc, "gate": "pair/5.2/1"}))
    assert load_manifest(path).gate == "pair/5.2/1"
    assert load_manifest(tmp_path.joinpath("m.json")).timeout == doc["timeout"]
    for wrong in ("producer/3.4/1", "pair/99/1"):
        path.write_text(json.dumps({**doc, "gate": wrong}))
        with pytest.raises(ManifestError, match="not a case of the pair suite"):
            load_manifest(path)


def test_a_mutant_run_with_no_pass_and_a_case_that_could_not_run_is_inconclusive() -> None:
    """Such a run is tried again on a node of its own; one where a case passed is a survivor."""
    from mutants.check import MutantResult

    def result(*verdicts: str) -> MutantResult:
        return MutantResult("m", "prefill", "own node", {str(i): v for i, v in enumerate(verdicts)})

    assert result("fail", "unsupported").inconclusive
    assert not result("fail", "unsupported").caught
    assert not result("fail", "pass", "unsupported").inconclusive
    assert not result("fail", "fail").inconclusive and result("fail", "fail").caught


def test_two_answers_are_one_computations_within_the_logprob_tolerance() -> None:
    """consumer/5.2/2 takes D's answer for a recompute when it is its local one: the same text
    and tokens, log probabilities a batch may move a little; KV not the prompt's moves them far."""
    from conformance.suites.consumer_env import same_output

    local = ("", [0, 5], [-1.0, -2.0])
    assert same_output(local, ("", [0, 5], [-1.004, -1.998]))
    assert not same_output(local, ("", [0, 5], [-1.0, -2.5]))
    assert not same_output(local, ("", [0, 6], [-1.0, -2.0]))
    assert same_output(("a", None, None), ("a", None, None))
    assert not same_output(("a", None, None), ("b", None, None))


@pytest.mark.parametrize("suite", ["pair", "preflight"])
def test_a_prefill_that_is_no_url_is_a_usage_error(
    suite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([suite, "--prefill", "p:8100", "--decode", "http://127.0.0.1:9"])
    assert exit_info.value.code == 2
    assert "argument --prefill: P's URL must be http(s)://host:port" in capsys.readouterr().err


def test_a_run_that_cannot_start_still_writes_its_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A testee nobody answers for: exit status 2, the reason on stderr, and the JSON and JUnit
    reports asked for, each case in them blocked with that reason."""
    from conformance.ports import free_port

    nobody = f"http://127.0.0.1:{free_port()}"
    paths = {"json": tmp_path / "r.json", "junit": tmp_path / "r.xml"}
    args = ["producer", "--api", nobody, "--bootstrap", nobody, "--cases", "producer/3.2/*"]
    args += ["--timeout", "1"]  # how long the harness waits for the testee that never comes
    code = cli.main([*args, "-q", "--json", str(paths["json"]), "--junit", str(paths["junit"])])
    assert code == 2
    reason = capsys.readouterr().err.strip().splitlines()[-1]
    assert reason.startswith("pdwire conformance producer: ") and nobody in reason
    doc = json.loads(paths["json"].read_text())
    assert doc["cases"] and {c["verdict"] for c in doc["cases"]} == {"blocked"}
    why = reason.removeprefix("pdwire conformance producer: ")
    assert {c["detail"] for c in doc["cases"]} == {f"not run: the run could not start: {why}"}
    failures = ET.parse(paths["junit"]).getroot().iter("failure")
    assert len(list(failures)) == len(doc["cases"])
