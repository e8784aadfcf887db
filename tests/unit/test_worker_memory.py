"""A node worker keeps the memory its KV math frees (``worker_process.keep_freed_memory``):
computing and checking a prompt's KV after the first one faults in no fresh pages."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

# Fills and checks a 1000-token prompt of the seeds' geometry (148.6 MB) in blocks that
# alternate between two halves of the pool, as consecutive requests do, and prints the minor
# page faults of the second to fourth prompt.
SCRIPT = """
    import random, resource, sys
    from reference_connector.kv_content import BlockTable, KVShape
    from reference_connector.kv_pool import KVPool
    from reference_connector.worker_process import keep_freed_memory

    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    shape = KVShape(num_layers=36, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=128)
    pool = KVPool(shape, 1, 0, 1, 0)
    ids = [random.Random(0).randrange(shape.vocab) for _ in range(1000)]
    faults = 0
    for n in range(4):
        first = n % 2 * 64
        table = BlockTable((tuple(range(first, first + 63)),), (0,))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        pool.write_prompt(ids, table)
        assert pool.verify(ids, table)[0]
        if n:
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults)
"""


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_worker_fills_and_checks_later_prompts_without_fresh_pages() -> None:
    kept = _faults("keep")
    assert kept < 100, f"{kept} page faults filling and checking prompts 2 to 4"
    # The same work without the setting: the C library hands the freed tensors back.
    handed_back = _faults("default")
    assert handed_back > 10 * max(kept, 100), (kept, handed_back)
