"""Version negotiation (spec §8.3-§8.5) and the rule that nothing is sent to a peer that cannot
decode it (§8.4)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

import pdwire
from pdwire import (
    LEGACY_PEER,
    NEGOTIATION_TABLE,
    Agreement,
    Capability,
    ErrorCode,
    Fingerprint,
    LocalProtocolError,
    Offer,
    PeerCannotDecode,
    XferCancel,
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseStatus,
    XferResponseV2,
    negotiate,
)
from pdwire.negotiation import PeerState
from pdwire.roles import Role
from pdwire.versions import ALL_CAPS, Profile

from .conftest import PULL_EXTENSIONS, RESPONSE_EXTENSIONS, wire_keys

ROLES: tuple[Role, ...] = ("prefill", "decode")
PROFILES: tuple[Profile, ...] = ("legacy", "pdwire/2")
PEER_STATES: tuple[PeerState, ...] = ("unknown", "legacy", "pdwire/2")
COMBINATIONS = list(itertools.product(ROLES, PROFILES, PEER_STATES))

LOCAL_CAPS = frozenset({"cancel", "fingerprint", "deadline"})
PEER_CAPS = frozenset({"cancel", "fingerprint", "auth", "future-cap"})


def peer_offer(state: PeerState, caps: frozenset[str] = PEER_CAPS) -> Offer | None:
    return {"unknown": None, "legacy": LEGACY_PEER, "pdwire/2": Offer(2, caps)}[state]


def agree(role: Role, local: Profile, peer: PeerState) -> Agreement:
    return negotiate(role, Offer.of(local, LOCAL_CAPS), peer_offer(peer))


def expected_announce(role: Role, local: Profile, peer: PeerState) -> bool:
    """§8.3 in words: a legacy side never announces; a pdwire/2 D announces unless P is known to
    be legacy; a pdwire/2 P announces only to a D that announced."""
    if local == "legacy":
        return False
    return peer != "legacy" if role == "decode" else peer == "pdwire/2"


FULL_RESPONSE = XferResponseV2(
    status=XferResponseStatus.FINISH,
    ok_reqs=["a"],
    err_reqs=["b"],
    err_msg="P num blocks less than D",
    layout_id=7,
    pdwire_version=2,
    pdwire_caps=sorted(ALL_CAPS),
    err_code=ErrorCode.P_BLOCKS_LESS_THAN_D,
    err_codes={"b": ErrorCode.P_BLOCKS_LESS_THAN_D},
    auth_tag=b"\x01" * 32,
)
FULL_PULL = XferMetadataV2(
    "10.0.0.7",
    17000,
    1,
    0,
    {"a": ("xfer-a", [[1, 2]])},
    [4096],
    [64],
    [64],
    layout_id=9,
    pdwire_version=2,
    pdwire_caps=sorted(ALL_CAPS),
    fingerprint=Fingerprint(
        model="m",
        dtype="bfloat16",
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        kv_layout="NHD",
    ),
    deadline_ms=1000,
    auth_tag=b"\x02" * 32,
)
CANCEL = XferCancel(2, "10.0.0.7", 17000, 1, 0, {"a": "xfer-a"}, reason="abort")


def test_table_has_exactly_the_twelve_combinations() -> None:
    assert len(NEGOTIATION_TABLE) == 12
    assert set(NEGOTIATION_TABLE) == set(COMBINATIONS)


@pytest.mark.parametrize(("role", "local", "peer"), COMBINATIONS)
def test_table_rows_follow_the_rules(role: Role, local: Profile, peer: PeerState) -> None:
    rule = NEGOTIATION_TABLE[(role, local, peer)]
    assert rule.announce is expected_announce(role, local, peer)
    assert rule.profile == ("pdwire/2" if rule.announce else "legacy")
    assert rule.why


@pytest.mark.parametrize(("role", "local", "peer"), COMBINATIONS)
def test_negotiate_applies_the_table(role: Role, local: Profile, peer: PeerState) -> None:
    offer = peer_offer(peer)
    agreement = agree(role, local, peer)
    rule = NEGOTIATION_TABLE[(role, local, peer)]
    assert agreement.profile == rule.profile
    assert agreement.announce is rule.announce
    assert agreement.peer_version == (None if offer is None else offer.version)
    both_pdwire2 = local == "pdwire/2" and peer == "pdwire/2"
    assert agreement.caps == (LOCAL_CAPS & PEER_CAPS if both_pdwire2 else frozenset())


@pytest.mark.parametrize(("role", "local", "peer"), COMBINATIONS)
@pytest.mark.parametrize("cap", list(Capability))
def test_require_raises_unless_the_cap_is_agreed(
    role: Role, local: Profile, peer: PeerState, cap: Capability
) -> None:
    agreement = agree(role, local, peer)
    agreed = local == "pdwire/2" and peer == "pdwire/2" and cap in LOCAL_CAPS & PEER_CAPS
    assert agreement.allows(cap) is agreed
    if agreed:
        agreement.require(cap, "test")
    else:
        with pytest.raises(PeerCannotDecode) as info:
            agreement.require(cap, "test")
        assert info.value.section == "8.4"
        assert isinstance(info.value, LocalProtocolError)


@pytest.mark.parametrize("version", [2, 3, 7, 1000])
@pytest.mark.parametrize("role", ROLES)
def test_a_peer_above_pdwire2_is_spoken_to_at_pdwire2(role: Role, version: int) -> None:
    agreement = negotiate(role, Offer.of("pdwire/2", LOCAL_CAPS), Offer(version, PEER_CAPS))
    assert agreement.profile == "pdwire/2"
    assert agreement.announce
    assert agreement.peer_version == version
    assert agreement.caps == LOCAL_CAPS & PEER_CAPS
    assert agreement.allows(Capability.CANCEL)


@pytest.mark.parametrize("version", [0, 1])
def test_a_peer_without_pdwire2_is_legacy(version: int) -> None:
    agreement = negotiate("prefill", Offer.of("pdwire/2", LOCAL_CAPS), Offer(version, PEER_CAPS))
    assert (agreement.profile, agreement.announce, agreement.caps) == ("legacy", False, frozenset())


def test_offer_of_legacy_drops_caps() -> None:
    assert Offer.of("legacy", LOCAL_CAPS) == LEGACY_PEER
    assert Offer.of("pdwire/2", LOCAL_CAPS) == Offer(2, LOCAL_CAPS)


# -- encode_cancel ------------------------------------------------------------------------------

CANCEL_REFUSED: dict[str, Agreement | Profile] = {
    "agreement-without-cancel": negotiate(
        "decode", Offer.of("pdwire/2", LOCAL_CAPS), Offer(2, frozenset({"fingerprint"}))
    ),
    "local-without-cancel": negotiate(
        "decode", Offer.of("pdwire/2", frozenset({"deadline"})), Offer(2, PEER_CAPS)
    ),
    "profile-legacy": "legacy",
    "d-peer-unknown": negotiate("decode", Offer.of("pdwire/2", LOCAL_CAPS), None),
    "d-peer-legacy": negotiate("decode", Offer.of("pdwire/2", LOCAL_CAPS), LEGACY_PEER),
    "d-legacy-peer-pdwire2": negotiate("decode", Offer.of("legacy"), Offer(2, PEER_CAPS)),
}


@pytest.mark.parametrize("profile", CANCEL_REFUSED.values(), ids=CANCEL_REFUSED.keys())
def test_cancel_to_a_peer_that_cannot_decode_it_is_refused(profile: Agreement | Profile) -> None:
    with pytest.raises(PeerCannotDecode) as info:
        pdwire.encode_cancel(CANCEL, profile)
    assert info.value.section == "8.4"


def test_cancel_with_agreed_cap_encodes() -> None:
    agreement = negotiate("decode", Offer.of("pdwire/2", LOCAL_CAPS), Offer(2, PEER_CAPS))
    assert agreement.allows(Capability.CANCEL)
    data = pdwire.encode_cancel(CANCEL, agreement)
    assert pdwire.decode_cancel(data) == CANCEL
    assert data == pdwire.encode_cancel(CANCEL, "pdwire/2")


# -- nothing sent that the peer cannot decode (§8.4) ---------------------------------------------

P_TO_NON_PDWIRE2 = [c for c in COMBINATIONS if c[0] == "prefill" and c[2] != "pdwire/2"]
D_TO_LEGACY = [c for c in COMBINATIONS if c[0] == "decode" and "legacy" in (c[1], c[2])]


@pytest.mark.parametrize(("role", "local", "peer"), P_TO_NON_PDWIRE2)
def test_p_sends_no_extension_to_a_d_that_did_not_announce(
    role: Role, local: Profile, peer: PeerState
) -> None:
    agreement = agree(role, local, peer)
    keys = wire_keys(pdwire.encode_response(FULL_RESPONSE, agreement))
    assert keys <= set(XferResponse.__struct_fields__)
    assert not keys & set(RESPONSE_EXTENSIONS)


@pytest.mark.parametrize(("role", "local", "peer"), D_TO_LEGACY)
def test_d_sends_no_extension_to_a_legacy_p(role: Role, local: Profile, peer: PeerState) -> None:
    agreement = agree(role, local, peer)
    keys = wire_keys(pdwire.encode_pull(FULL_PULL, agreement))
    assert keys <= set(XferMetadata.__struct_fields__)
    assert not keys & set(PULL_EXTENSIONS)


@pytest.mark.parametrize(("role", "local", "peer"), COMBINATIONS)
def test_extensions_travel_exactly_when_announcing(
    role: Role, local: Profile, peer: PeerState
) -> None:
    agreement = agree(role, local, peer)
    if role == "decode":
        keys = wire_keys(pdwire.encode_pull(FULL_PULL, agreement)) & set(PULL_EXTENSIONS)
    else:
        keys = wire_keys(pdwire.encode_response(FULL_RESPONSE, agreement)) & set(
            RESPONSE_EXTENSIONS
        )
    assert bool(keys) is agreement.announce


# -- unknown profiles ---------------------------------------------------------------------------

BAD_PROFILES = ["", "pdwire/3", "PDWIRE/2", "Legacy", "v2"]

ENCODE_WITH_PROFILE: dict[str, Callable[[Any], bytes]] = {
    "pull-v2": lambda p: pdwire.encode_pull(FULL_PULL, p),
    "pull-base": lambda p: pdwire.encode_pull(XferMetadata("h", 1, 1, 0, {}, [], [], []), p),
    "response-v2": lambda p: pdwire.encode_response(FULL_RESPONSE, p),
    "response-base": lambda p: pdwire.encode_response(XferResponse(status=0), p),
    "cancel": lambda p: pdwire.encode_cancel(CANCEL, p),
}


@pytest.mark.parametrize("profile", BAD_PROFILES)
@pytest.mark.parametrize("call", ENCODE_WITH_PROFILE.values(), ids=ENCODE_WITH_PROFILE.keys())
def test_unknown_profile_names_raise(call: Callable[[Any], bytes], profile: Any) -> None:
    with pytest.raises(LocalProtocolError) as info:
        call(profile)
    assert info.value.section == "8.1"


@pytest.mark.parametrize("profile", BAD_PROFILES)
def test_offer_of_an_unknown_profile_raises(profile: Any) -> None:
    with pytest.raises(LocalProtocolError):
        Offer.of(profile)
