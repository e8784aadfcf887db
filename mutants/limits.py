"""Mutants of the limits of chapter 13: a P, a bootstrap server and a proxy that enforce none,
and a P whose limits are below the minimums every implementation supports."""

from __future__ import annotations

from . import mutant, producer_limits, replace

UNLIMITED = 1 << 62


@mutant(
    "p-unlimited",
    "prefill",
    "holds any number of requests, open pulls, placeholders and remembered cancels per D worker",
    cases=(
        "producer/13.2/1",
        "producer/13.2/2",
        "producer/13.3/1",
        "producer/13.4/1",
        "producer/13.4/2",
    ),
)
def _unlimited() -> None:
    producer_limits(
        requests_per_message=UNLIMITED,
        open_pulls_per_peer=UNLIMITED,
        placeholders_per_peer=UNLIMITED,
        remembered_cancels_per_peer=UNLIMITED,
    )


@mutant(
    "p-below-minimums",
    "prefill",
    "refuses what stays within the minimums: half of each count, 32 cached layouts",
    cases=("producer/13.1/1", "producer/13.5/1"),
)
def _below_minimums() -> None:
    producer_limits(
        requests_per_message=512,
        open_pulls_per_peer=32,
        placeholders_per_peer=512,
        cached_layouts=32,
    )


@mutant(
    "bootstrap-unlimited",
    "prefill",
    "registers any number of workers",
    cases=("producer/13.6/1",),
    at_start=True,  # a node of its own: the case fills the registry of the node it runs on
)
def _bootstrap_unlimited() -> None:
    from reference_connector.bootstrap import Registry

    # A data descriptor wins over the instance's own attribute.
    replace(Registry, "max_workers", property(lambda self: None, lambda self, value: None))


@mutant(
    "proxy-no-body-limit",
    "proxy",
    "reads a completion request of any size",
    cases=("proxy/13.7/1",),
)
def _proxy_no_body_limit() -> None:
    from reference_connector import proxy

    replace(proxy, "COMPLETION_BODY_LIMIT", UNLIMITED)
