"""The two roles of the protocol, named once: a prefill instance (P) computes a prompt's KV and
writes it; a decode instance (D) pulls it and decodes."""

from __future__ import annotations

from typing import Final, Literal

Role = Literal["prefill", "decode"]
#: How the spec writes each role.
LETTER: Final[dict[Role, str]] = {"prefill": "P", "decode": "D"}
