"""Integration tests: the reference connector's transport and bootstrap on loopback."""
