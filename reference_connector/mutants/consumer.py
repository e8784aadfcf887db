"""Mutants of the D side (caught by consumer and pair cases)."""

from __future__ import annotations
