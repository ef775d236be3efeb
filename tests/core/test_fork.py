"""A process forked while the hash worker (``background_hashing``) hashes a
prompt: the child has no worker thread, and must answer with the right
hashes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="os.fork in a threaded process: Linux only"
)

# Run in a fresh interpreter, so a hang costs a timeout, not the suite. The
# parent forks while the worker hashes a long prompt; the child reads the
# prompt's hashes and a lookup, and reports them through a pipe.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time, warnings
    import numpy as np
    import pagedkv as pk

    warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
    config = pk.KVCacheConfig(num_blocks=64, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    n = 1 << 23
    m = pk.KVCacheManager(config, max_model_len=n, background_hashing=True)
    m.add_request("warm", list(range(64)))
    m.block_hashes("warm")
    m.add_request("r", np.arange(n, dtype=np.int64) % 50_000)
    time.sleep(0.01)  # the worker has taken the prompt
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        h = m.block_hashes("r")
        hit = m.get_computed_blocks("r")
        m.add_request("after", list(range(64)))  # a new worker in the child
        m.check_invariants()
        os.write(write, f"{len(h)} {hash(tuple(h))} {hit.num_computed_tokens}".encode())
        os._exit(0)
    os.close(write)
    h = m.block_hashes("r")
    expected = f"{len(h)} {hash(tuple(h))} 0"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        sys.exit("the child did not answer")
    got = os.read(read, 1000).decode()
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert got == expected, (got, expected)
    print("ok", got)
    """
)


def test_a_child_forked_while_a_prompt_is_hashed_answers() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONHASHSEED": "0", "PATH": ""},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("ok 524288 ")
