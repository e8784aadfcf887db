"""``cli_common.serve``, the serving loop of ``pdwire node``, ``bootstrap`` and ``proxy``: a
SIGTERM that comes while the server starts stops it cleanly once it has started."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: A server whose start gets a SIGTERM, served by ``serve``.
SCRIPT = """
    import os, signal, sys
    from reference_connector import cli_common

    class Server:
        alive = True

        def stop(self):
            print("stopped", flush=True)

    def start():
        os.kill(os.getpid(), signal.SIGTERM)
        return Server()

    sys.exit(cli_common.serve("test", start, lambda server: "serving"))
"""


def test_a_sigterm_during_the_start_stops_the_server_once_started() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout.split()) == (0, ["serving", "stopped"]), done.stderr
