"""The case families, one module each (``producer_*``, ``consumer_*``, ``pair_*``, ``proxy_*``,
``registration``); importing this package registers every case."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name.split("_")[0] in ("producer", "consumer", "pair", "proxy", "registration"):
        importlib.import_module(f"{__name__}.{_module.name}")
