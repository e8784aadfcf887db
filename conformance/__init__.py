"""pdwire's conformance harness: checks a producer, a consumer or a P/D pair against the spec.

It depends on ``pdwire`` alone and never reuses ``reference_connector`` to probe a testee.
"""

__version__ = "0.1.0"
