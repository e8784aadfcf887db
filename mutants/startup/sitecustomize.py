"""Python imports this module at start-up when its folder is on ``PYTHONPATH``
(``mutants.preload.environ``): it applies the mutant the environment names."""

import os

if os.environ.get("PDWIRE_MUTANT") or os.environ.get("PDWIRE_MUTANT_SWITCH"):
    from mutants import preload

    preload.start()
