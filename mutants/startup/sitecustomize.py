"""Python imports this module at start-up when its folder is on ``PYTHONPATH``
(``mutants.preload.environ``): it applies the mutant the environment names, except in
multiprocessing's resource tracker, which runs none of pdwire's code (loading the mutants there
cost each node about half a second of CPU)."""

import os
import sys

_TRACKER = "multiprocessing.resource_tracker"

if (os.environ.get("PDWIRE_MUTANT") or os.environ.get("PDWIRE_MUTANT_SWITCH")) and not any(
    _TRACKER in arg for arg in getattr(sys, "orig_argv", ())
):
    from mutants import preload

    preload.start()
