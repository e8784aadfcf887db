"""Coverage-guided fuzzing of pdwire's decoders and sessions (atheris/libFuzzer).

``fuzz.targets.TARGETS`` names every target: a function of one input's bytes that returns
normally or raises a typed pdwire error (swallowed by the target itself) and raises anything
else only on a real bug. ``python -m fuzz --help`` runs them.
"""
