"""How a node worker runs its KV math: it keeps the memory the math frees
(``worker_process.keep_freed_memory``), so that computing and checking a prompt's KV after the
first one faults in no fresh pages; and it computes a decoded token's KV on one torch thread."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from reference_connector.kv_content import BlockTable, KVShape
from reference_connector.kv_pool import KVPool
from reference_connector.worker_process import _Worker

# Fills and checks a 1000-token prompt of the seeds' geometry (148.6 MB) in blocks that
# alternate between two halves of the pool, as consecutive requests do, and prints the minor
# page faults of the second to fourth prompt.
SCRIPT = """
    import dataclasses, random, resource, sys
    from reference_connector.kv_content import BlockTable
    from reference_connector.kv_pool import KVPool
    from reference_connector.run import RunConfig
    from reference_connector.worker_process import keep_freed_memory

    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    shape = dataclasses.replace(RunConfig().shape(), num_blocks=128)
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


def test_a_decoded_token_is_computed_on_one_torch_thread() -> None:
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=4)
    pool = KVPool(shape, 1, 0, 1, 0)
    table = BlockTable(((1, 2),), (0,))
    worker = _Worker.__new__(_Worker)  # the ops, without a spec or a pipe
    worker.pool, worker._digests = pool, {"r": pool.new_digest()}
    seen: list[int] = []
    append = pool.append

    def counting(*args: object) -> None:
        seen.append(torch.get_num_threads())
        append(*args)  # type: ignore[arg-type]

    pool.append = counting  # type: ignore[method-assign]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool.write_prompt([3, 1, 4], table)
        digests = worker.op_append("r", 7, 3, table)
        assert seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert len(digests) == 2 * 2 * 2 * 8  # layers x K/V x heads, 8 bytes each
