"""A deterministic simulator of P/D clusters in virtual time, driving the real sessions."""

from .cluster import FAULTS, Cluster, SimParams
from .geometry import Geometry
from .report import Report, simulate

__all__ = ["FAULTS", "Cluster", "Geometry", "Report", "SimParams", "simulate"]
