"""Wire versions, profiles and capabilities (spec §8.1, §8.5)."""

from __future__ import annotations

import enum
from typing import Final, Literal

from . import sections
from .errors import LocalProtocolError

Profile = Literal["legacy", "pdwire/2"]

LEGACY: Final[Profile] = "legacy"
PDWIRE_2: Final[Profile] = "pdwire/2"

#: Wire version of each profile. Version 1 is what vLLM 0.34 speaks; it never announces it.
WIRE_VERSION: Final[dict[Profile, int]] = {LEGACY: 1, PDWIRE_2: 2}
#: The highest wire version this library speaks.
CURRENT_VERSION: Final = 2


class Capability(enum.StrEnum):
    """Optional pdwire/2 behaviours a side announces; both must announce one to use it (§8.5)."""

    CANCEL = "cancel"
    WILL_NOT_SEND = "will-not-send"
    FINGERPRINT = "fingerprint"
    DEADLINE = "deadline"
    AUTH = "auth"


ALL_CAPS: Final = frozenset(c.value for c in Capability)


def check_profile(profile: str) -> Profile:
    """Return ``profile`` if it names a profile, else raise naming the known ones."""
    if profile not in WIRE_VERSION:
        raise LocalProtocolError(
            f"unknown profile {profile!r}; expected one of {sorted(WIRE_VERSION)}",
            section=sections.VERSIONS,
        )
    return LEGACY if profile == LEGACY else PDWIRE_2


def profile_of_version(version: int) -> Profile:
    """The profile to speak with a peer that announced ``version`` (0 = did not announce).

    A peer announcing a version above ours is spoken to at ours: it understands every older one.
    """
    return PDWIRE_2 if version >= WIRE_VERSION[PDWIRE_2] else LEGACY
