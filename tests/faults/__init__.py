"""Fault injection with real processes on loopback: ``pdwire node``, ``bootstrap`` and
``proxy`` started as child processes, killed, restarted, slowed down or relayed."""
