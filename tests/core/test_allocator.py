"""The extension module's heap (``rust/pagedkv-py/src/alloc.rs``): memory its
requests freed is reused without the OS faulting it in again."""

from __future__ import annotations

import resource
import sys
import time

import numpy as np
import pytest

from tests._util import make_manager


@pytest.mark.skipif(sys.platform != "linux", reason="counts the process's page faults")
def test_freed_request_memory_is_reused_without_page_faults() -> None:
    # Prompts of ~10 KB, below the 16 KiB the module's small-block allocator
    # (mimalloc) serves: their token buffers and hash vectors come from it.
    # Left to its defaults, mimalloc hands the memory of pages left empty back
    # to the OS a second later, and the next wave of requests faults
    # it in again (hundreds of faults here, 2 MiB huge pages each where
    # transparent huge pages are on); the module keeps it.
    prompts = [np.arange(i * 5000, i * 5000 + 2500, dtype=np.uint32) for i in range(300)]
    ids = [f"r{i}" for i in range(len(prompts))]
    mgr = make_manager(num_blocks=64, max_model_len=4096)

    def wave() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for rid, prompt in zip(ids, prompts, strict=True):
            mgr.add_request(rid, prompt)
        for rid in ids:
            mgr.remove_request(rid)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    wave()
    wave()
    # Past mimalloc's purge delay (1 s by default in its version 3).
    time.sleep(1.2)
    assert wave() <= 8
