"""The case families, one module each; importing this package registers every case."""

from . import producer_basic  # noqa: F401
