"""The end-to-end check on CUDA: the tiny hybrid transformer generates with its KV
cache on the GPU (block tables uploaded from pinned memory every step), and every
logit must equal the dense reference. Also times the per-step block-table upload.

    python tests/gpu/check_cuda.py        # exits 0 with "skipped" when CUDA is absent

``tests/torch/test_torch_cuda.py`` runs the same scenarios under pytest (skipped without
CUDA).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

try:
    import torch
except ImportError:  # a script, not a pytest module: say so and stop, as without CUDA
    if __name__ == "__main__":
        print("torch not installed: skipped")
        raise SystemExit(0) from None
    raise

from pagedkv.torch import PagedEngine, TinyConfig, TinyTransformer

TOL = 1e-4


@dataclass
class Result:
    name: str
    max_error: float
    steps: int
    preemptions: int
    swaps: int
    hit_tokens: int
    upload_us: float
    slot_mapping_us: float
    seconds: float

    def ok(self) -> bool:
        return self.max_error < TOL


def _prompts(seed: int, n: int, tail: tuple[int, int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(1, 128, size=13).tolist()
    return [
        (base if i % 3 else base[:5]) + rng.integers(1, 128, size=int(rng.integers(*tail))).tolist()
        for i in range(n)
    ]


def _run(
    name: str,
    device: str,
    build: Callable[[TinyTransformer], PagedEngine],
    layer_types: tuple[str, ...] = ("full", "sliding", "full", "sliding"),
    fork: bool = False,
) -> Result:
    model = TinyTransformer(TinyConfig(layer_types=layer_types, attention_chunk_size=8), seed=0)
    model.to(device)
    engine = build(model)
    assert engine.kv_cache.device.type == torch.device(device).type
    t = time.perf_counter()
    for i, p in enumerate(_prompts(1, 8, (8, 16))):
        engine.add_request(f"r{i}", p, max_tokens=12, seed=i if i % 2 else None)
    outs = []
    while engine.has_unfinished:
        outs.append(engine.step())
        if fork and len(outs) == 6:
            running = [r.request_id for r in engine.running]
            if running:
                engine.fork_request(running[0], "fork", max_tokens=6, seed=7)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    reqs = engine.requests.values()
    return Result(
        name=name,
        max_error=max(engine.max_logit_error(r) for r in engine.requests),
        steps=len(outs),
        preemptions=sum(r.num_preemptions for r in reqs),
        swaps=sum(r.num_swaps for r in reqs),
        hit_tokens=sum(r.num_hit_tokens for r in reqs),
        upload_us=float(np.mean([o.upload_ns for o in outs])) / 1e3,
        slot_mapping_us=float(np.mean([o.slot_mapping_ns for o in outs])) / 1e3,
        seconds=seconds,
    )


def scenarios(device: str) -> list[Result]:
    common = {
        "block_size": 4,
        "max_model_len": 48,
        "max_num_reqs": 6,
        "max_num_batched_tokens": 24,
        "poison_free_blocks": True,
    }
    return [
        _run("caching on", device, lambda m: PagedEngine(m, num_blocks=128, **common)),
        _run(
            "caching off",
            device,
            lambda m: PagedEngine(m, num_blocks=128, enable_caching=False, **common),
        ),
        _run("pressure, recompute", device, lambda m: PagedEngine(m, num_blocks=34, **common)),
        _run(
            "pressure, swap",
            device,
            lambda m: PagedEngine(
                m, num_blocks=34, preemption_mode="swap", num_cpu_blocks=64, **common
            ),
        ),
        _run("fork", device, lambda m: PagedEngine(m, num_blocks=128, **common), fork=True),
        _run(
            "chunked local",
            device,
            lambda m: PagedEngine(m, num_blocks=96, **common),
            layer_types=("chunked", "full", "chunked"),
        ),
    ]


def main() -> int:
    if not torch.cuda.is_available():
        print("CUDA not available: skipped")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    results = scenarios("cuda")
    for r in results:
        print(
            f"{r.name:22s} max|Δlogit|={r.max_error:.2e} steps={r.steps} "
            f"preempt={r.preemptions} swaps={r.swaps} hits={r.hit_tokens} "
            f"upload={r.upload_us:.1f}us/step slots={r.slot_mapping_us:.1f}us/step "
            f"{r.seconds:.2f}s {'OK' if r.ok() else 'FAIL'}"
        )
    return 0 if all(r.ok() for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
