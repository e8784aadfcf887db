"""Version negotiation as a pure function over a table (spec §8.3).

Each side knows what it speaks (an ``Offer``) and what it has learned of its peer: nothing yet,
that the peer is legacy (it registered, queried or answered without a version), or the peer's own
offer. The table gives the profile to send with and whether to announce; capabilities in use are
those both sides announced.
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

from . import sections
from .errors import PeerCannotDecode
from .roles import Role
from .versions import (
    LEGACY,
    PDWIRE_2,
    WIRE_VERSION,
    Capability,
    Profile,
    check_profile,
    profile_of_version,
)

PeerState = Literal["unknown", "legacy", "pdwire/2"]


@dataclasses.dataclass(frozen=True)
class Offer:
    """What one side speaks: its highest wire version and the capabilities it announces."""

    version: int
    caps: frozenset[str] = frozenset()

    @classmethod
    def of(cls, profile: Profile, caps: frozenset[str] = frozenset()) -> Offer:
        profile = check_profile(profile)
        return cls(WIRE_VERSION[profile], caps if profile != LEGACY else frozenset())


#: A peer known to speak only the legacy profile.
LEGACY_PEER: Final = Offer(WIRE_VERSION[LEGACY])


@dataclasses.dataclass(frozen=True)
class Rule:
    profile: Profile
    announce: bool
    why: str


#: (our role, our profile, what we know of the peer) -> how we send. Every combination is here.
NEGOTIATION_TABLE: Final[dict[tuple[Role, Profile, PeerState], Rule]] = {
    ("decode", LEGACY, "unknown"): Rule(LEGACY, False, "a legacy D never announces"),
    ("decode", LEGACY, "legacy"): Rule(LEGACY, False, "both legacy"),
    ("decode", LEGACY, "pdwire/2"): Rule(LEGACY, False, "a legacy D never announces"),
    ("decode", PDWIRE_2, "unknown"): Rule(
        PDWIRE_2, True, "D announces in its pull; a legacy P ignores the extra keys"
    ),
    ("decode", PDWIRE_2, "legacy"): Rule(LEGACY, False, "P is known to be legacy"),
    ("decode", PDWIRE_2, "pdwire/2"): Rule(PDWIRE_2, True, "both pdwire/2"),
    ("prefill", LEGACY, "unknown"): Rule(LEGACY, False, "a legacy P never announces"),
    ("prefill", LEGACY, "legacy"): Rule(LEGACY, False, "both legacy"),
    ("prefill", LEGACY, "pdwire/2"): Rule(LEGACY, False, "a legacy P never announces"),
    ("prefill", PDWIRE_2, "unknown"): Rule(
        LEGACY, False, "P answers with its version only to a D that announced"
    ),
    ("prefill", PDWIRE_2, "legacy"): Rule(LEGACY, False, "D did not announce"),
    ("prefill", PDWIRE_2, "pdwire/2"): Rule(PDWIRE_2, True, "both pdwire/2"),
}


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How to talk to one peer, as far as is known now."""

    profile: Profile
    peer_version: int | None
    caps: frozenset[str]
    announce: bool

    def allows(self, cap: Capability) -> bool:
        """True when the peer is known to speak pdwire/2 and both sides announced ``cap``."""
        return (self.peer_version or 0) >= WIRE_VERSION[PDWIRE_2] and cap.value in self.caps

    def require(self, cap: Capability, what: str) -> None:
        """Raise ``PeerCannotDecode`` unless ``cap`` is agreed: the rule of §8.4."""
        if not self.allows(cap):
            raise PeerCannotDecode(
                f"{what} needs pdwire/2 with capability {cap.value!r}, which the peer has not "
                f"announced (peer version {self.peer_version}, agreed {sorted(self.caps)})",
                section=sections.DECODABILITY,
            )


def peer_state(peer: Offer | None) -> PeerState:
    if peer is None:
        return "unknown"
    return profile_of_version(peer.version)


def negotiate(role: Role, local: Offer, peer: Offer | None) -> Agreement:
    """How ``role``, speaking ``local``, sends to a peer of which it knows ``peer``.

    ``peer`` is None while nothing is known; ``LEGACY_PEER`` once the peer showed no version.
    """
    rule = NEGOTIATION_TABLE[(role, profile_of_version(local.version), peer_state(peer))]
    caps = local.caps & peer.caps if rule.profile == PDWIRE_2 and peer is not None else frozenset()
    return Agreement(
        profile=rule.profile,
        peer_version=None if peer is None else peer.version,
        caps=frozenset(caps),
        announce=rule.announce,
    )
