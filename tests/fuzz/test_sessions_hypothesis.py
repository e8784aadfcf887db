"""Hypothesis drives both sessions through the fuzz targets' programs: unlike the stateful
machines of tests/unit/test_state_machines.py, with random TP/PP shapes on both sides, both
profiles, signed, mis-signed, mutated and raw frames, bootstrap entries decoded from arbitrary
JSON, and the driver's own misuse (which must be refused without changing the session)."""

from __future__ import annotations

from typing import Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.runner import CORPUS
from fuzz.targets import TARGETS

SESSION: Final = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("target", ["producer", "consumer"])
@SESSION
@given(program=st.binary(min_size=8, max_size=400))
def test_session_keeps_its_invariants_on_any_program(target: str, program: bytes) -> None:
    TARGETS[target](program)


@pytest.mark.parametrize("target", ["producer", "consumer"])
@SESSION
@given(data=st.data())
def test_session_keeps_its_invariants_on_corpus_programs_spliced(
    target: str, data: st.DataObject
) -> None:
    """Programs from the corpus, cut and joined: deep states reached by fuzzing, then more."""
    corpus = sorted((CORPUS / target).iterdir())
    a = data.draw(st.sampled_from(corpus)).read_bytes()
    b = data.draw(st.sampled_from(corpus)).read_bytes()
    cut = data.draw(st.integers(0, len(a)))
    TARGETS[target](a[:cut] + data.draw(st.binary(max_size=16)) + b)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_committed_corpus_replays_clean(target: str) -> None:
    """Every corpus input, straight through its target (no atheris needed)."""
    for path in sorted((CORPUS / target).iterdir()):
        TARGETS[target](path.read_bytes())
