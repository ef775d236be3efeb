"""Building a :class:`~pagedkv.specs.KVCacheConfig` from per-layer specs and a memory
budget, with vLLM 0.33's rules (``vllm/v1/core/kv_cache_planning.py`` and
``kv_cache_utils.py``; the function names are vLLM's).

>>> import pagedkv as pk
>>> specs = {f"layers.{i}": pk.FullAttentionSpec(16, 8, 128, "bfloat16") for i in range(32)}
>>> config = pk.get_kv_cache_config(specs, 8 << 30, max_model_len=8192)
>>> config.num_blocks, len(config.kv_cache_groups), len(config.kv_cache_tensors)
(4096, 1, 32)

Grouping (:func:`get_kv_cache_groups`):

1. Every layer has the same spec (up to merging): one group.
2. One type with different page sizes (e.g. head counts): one group with a
   :class:`~pagedkv.specs.UniformTypeKVCacheSpecs`.
3. Otherwise (hybrid models) the page sizes are made equal
   (:func:`unify_kv_cache_spec_page_size`: a smaller attention page takes a larger
   block size, or is padded; a Mamba page is padded), layers are bucketed by spec,
   and every bucket is cut into groups of ``group_size`` layers (the smallest
   bucket, or the largest when it is under 1.5x the smallest) with strided
   assignment ``layers[i::num_groups]``.

Memory: one block id costs ``bytes_per_block`` = the layers of the largest group
times the page size (every group's layer *i* shares the buffer of tensor *i*),
``num_blocks = available_memory // bytes_per_block``. The check that one request
of ``max_model_len`` fits keeps one block back for the null block.

This is the layer-outermost layout (vLLM's ``LBNHC`` / ``NHD``, one tensor per
layer slot). vLLM's block-outermost packing of mixed page sizes
(``_get_packed_kv_cache_groups``), HiSparse, hidden-state cache layers, DCP and the
``disable_hybrid_kv_cache_manager`` fallback are not reproduced.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._util import cdiv
from .errors import InvalidConfigError
from .specs import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)

__all__ = [
    "NotEnoughKVCacheMemoryError",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "get_kv_cache_capacity",
    "get_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "get_max_concurrency_for_kv_cache_config",
    "get_uniform_page_size",
    "is_kv_cache_spec_uniform",
    "max_memory_usage_bytes",
    "unify_kv_cache_spec_page_size",
]

_GiB = 1 << 30


class NotEnoughKVCacheMemoryError(InvalidConfigError):
    """The memory cannot hold the KV cache of one request of ``max_model_len``
    tokens (vLLM raises ``ValueError`` with the same text). The numbers are
    attributes too."""

    def __init__(
        self,
        message: str,
        *,
        max_model_len: int,
        needed_memory: int,
        available_memory: int,
        estimated_max_model_len: int,
    ) -> None:
        super().__init__(message)
        self.max_model_len = max_model_len
        self.needed_memory = needed_memory
        self.available_memory = available_memory
        self.estimated_max_model_len = estimated_max_model_len


def _format_gib(b: int) -> str:
    return f"{round(b / _GiB, 2)}"


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise InvalidConfigError(f"{name} must be a {kind} int, got {value!r}")


def _check_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    if not isinstance(kv_cache_specs, Mapping):
        raise TypeError(
            f"kv_cache_specs must map layer names to KVCacheSpec, got {kv_cache_specs!r}"
        )
    for name, spec in kv_cache_specs.items():
        if not isinstance(name, str):
            raise TypeError(f"layer names must be str, got {name!r}")
        if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
            raise TypeError(f"layer {name!r}: expected a per-layer KVCacheSpec, got {spec!r}")
    return dict(kv_cache_specs)


def _spec_max_memory(spec: KVCacheSpec, sizing: _Sizing) -> int:
    return spec.max_memory_usage_bytes(
        sizing.max_model_len,
        sizing.max_in_flight_tokens,
        max_num_encoder_input_tokens=sizing.max_num_encoder_input_tokens,
    )


@dataclasses.dataclass(frozen=True)
class _Sizing:
    max_model_len: int
    max_in_flight_tokens: int | None
    max_num_encoder_input_tokens: int | None

    def with_max_model_len(self, max_model_len: int) -> _Sizing:
        return dataclasses.replace(self, max_model_len=max_model_len)


def _sizing(
    max_model_len: int,
    max_in_flight_tokens: int | None,
    max_num_encoder_input_tokens: int | None,
) -> _Sizing:
    _check_int("max_model_len", max_model_len, minimum=1)
    if max_in_flight_tokens is not None:
        _check_int("max_in_flight_tokens", max_in_flight_tokens, minimum=1)
    if max_num_encoder_input_tokens is not None:
        _check_int("max_num_encoder_input_tokens", max_num_encoder_input_tokens, minimum=1)
    return _Sizing(max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens)


# --------------------------------------------------------------------------- grouping


def is_kv_cache_spec_uniform(kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
    """Whether every layer can share one group and one spec (vLLM: the specs
    merge). An empty mapping is uniform."""
    specs = list(kv_cache_specs.values())
    if not specs:
        return True
    try:
        type(specs[0]).merge(specs)
    except ValueError:
        return False
    return True


def get_uniform_page_size(kv_cache_specs: Iterable[KVCacheSpec]) -> int:
    """The page size every spec shares (``InvalidConfigError`` if they differ)."""
    page_sizes = {spec.page_size_bytes for spec in kv_cache_specs}
    if len(page_sizes) != 1:
        raise InvalidConfigError(f"expected one page size, got {sorted(page_sizes)}")
    return page_sizes.pop()


def unify_kv_cache_spec_page_size(
    kv_cache_specs: Mapping[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """Make every page the size of the largest: a smaller attention page whose size
    divides it takes a proportionally larger block size; a Mamba page, or a non-MLA
    attention page that does not divide it, is padded (``page_size_padded``).
    Raises ``InvalidConfigError`` when neither works (e.g. an MLA page that does not
    divide the largest)."""
    specs = dict(kv_cache_specs)
    page_sizes = {spec.page_size_bytes for spec in specs.values()}
    if len(page_sizes) <= 1:
        return specs
    max_page_size = max(page_sizes)
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        new_spec: KVCacheSpec
        if page == max_page_size:
            new_spec = spec
        elif isinstance(spec, MambaSpec):
            new_spec = dataclasses.replace(spec, page_size_padded=max_page_size)
        elif max_page_size % page == 0:
            new_spec = spec.copy_with_new_block_size(spec.block_size * (max_page_size // page))
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            new_spec = dataclasses.replace(spec, page_size_padded=max_page_size)
        else:
            raise InvalidConfigError(
                f"layer {name!r}: its page ({page} bytes) does not divide the largest page "
                f"({max_page_size} bytes) and cannot be padded (padding is only supported for "
                "non-MLA attention and Mamba layers)"
            )
        assert new_spec.page_size_bytes == max_page_size
        unified[name] = new_spec
    return unified


def _create_kv_cache_group_specs(
    kv_cache_specs: Mapping[str, KVCacheSpec], grouped_layer_names: list[list[str]]
) -> list[KVCacheGroupSpec]:
    groups = []
    for names in grouped_layer_names:
        layer_specs = [kv_cache_specs[n] for n in names]
        groups.append(KVCacheGroupSpec(names, type(layer_specs[0]).merge(layer_specs)))
    return groups


def _get_kv_cache_groups_uniform_page_size(
    kv_cache_specs: Mapping[str, KVCacheSpec],
) -> list[KVCacheGroupSpec]:
    # Bucket layers by spec, in first-seen order.
    same_spec_layers: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_specs.items():
        same_spec_layers.setdefault(spec, []).append(name)
    # Merge buckets whose specs merge (fewer groups).
    layer_buckets: list[list[str]] = []
    spec_buckets: list[list[KVCacheSpec]] = []
    for spec, names in same_spec_layers.items():
        for bucket_names, bucket_specs in zip(layer_buckets, spec_buckets, strict=True):
            try:
                type(bucket_specs[0]).merge([*bucket_specs, spec])
            except ValueError:
                continue
            bucket_names.extend(names)
            bucket_specs.append(spec)
            break
        else:
            layer_buckets.append(list(names))
            spec_buckets.append([spec])
    # Equal-size groups: the "1" of an n:1 pattern, or the largest bucket when the
    # buckets are close (gpt-oss + EAGLE: 12 SWA + 13 full -> groups of 13).
    min_num_layers = min(len(b) for b in layer_buckets)
    max_num_layers = max(len(b) for b in layer_buckets)
    group_size = max_num_layers if max_num_layers < min_num_layers * 1.5 else min_num_layers
    grouped: list[list[str]] = []
    for names in layer_buckets:
        num_groups = cdiv(len(names), group_size)
        # Strided, so that pipeline stages stay balanced.
        grouped.extend(names[i::num_groups] for i in range(num_groups))
    return _create_kv_cache_group_specs(kv_cache_specs, grouped)


def get_kv_cache_groups(kv_cache_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Split the layers into KV-cache groups (layers sharing a block table), with
    vLLM's rules (see the module docstring). ``[]`` for an attention-free model."""
    specs = _check_specs(kv_cache_specs)
    if not specs:
        return []
    if is_kv_cache_spec_uniform(specs):
        return _create_kv_cache_group_specs(specs, [list(specs)])
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    if uniform is not None:
        return [KVCacheGroupSpec(list(specs), uniform)]
    return _get_kv_cache_groups_uniform_page_size(unify_kv_cache_spec_page_size(specs))


# ----------------------------------------------------------------- memory and tensors


def _group_layer_pages(group: KVCacheGroupSpec) -> list[tuple[str, int]]:
    """(layer, page bytes) in buffer order: a ``UniformTypeKVCacheSpecs`` group places
    layers with equal specs together (first-seen order), as vLLM 0.33 does."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        by_spec: dict[KVCacheSpec, list[str]] = {}
        for name in group.layer_names:
            by_spec.setdefault(spec.kv_cache_specs[name], []).append(name)
        return [(n, s.page_size_bytes) for s, names in by_spec.items() for n in names]
    return [(n, spec.page_size_bytes) for n in group.layer_names]


def _bytes_per_block(kv_cache_groups: Iterable[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs: the largest group's pages, summed over its layers."""
    return max(sum(p for _, p in _group_layer_pages(g)) for g in kv_cache_groups)


def get_kv_cache_config_from_groups(
    kv_cache_groups: Iterable[KVCacheGroupSpec],
    available_memory: int,
    *,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """The config of ``kv_cache_groups`` in ``available_memory`` bytes:
    ``num_blocks = available_memory // bytes_per_block`` (or
    ``num_gpu_blocks_override``), and one tensor of ``page * num_blocks`` bytes per
    layer slot, shared by the layer in that slot of every group. No memory check
    (see :func:`get_kv_cache_config`)."""
    groups = list(kv_cache_groups)
    if not groups:
        raise InvalidConfigError("the model has no KV-cache layers (no groups)")
    _check_int("available_memory", available_memory, minimum=0)
    if num_gpu_blocks_override is not None:
        _check_int("num_gpu_blocks_override", num_gpu_blocks_override, minimum=1)
    bytes_per_block = _bytes_per_block(groups)
    num_blocks = available_memory // bytes_per_block
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    if num_blocks <= 0:
        raise InvalidConfigError(
            f"{available_memory} bytes of memory hold no block ({bytes_per_block} bytes per block)"
        )
    # Layer-outermost: a group's layers sit one after the other, each taking
    # page * num_blocks bytes; every group starts at byte 0, so regions with the same
    # (offset, size) in different groups are one shared buffer.
    regions: dict[tuple[int, int], list[str]] = {}
    for group in groups:
        offset = 0
        for name, page in _group_layer_pages(group):
            size = page * num_blocks
            regions.setdefault((offset, size), []).append(name)
            offset += size
    starts = sorted(regions)
    for (start, size), (next_start, _) in itertools.pairwise(starts):
        if start + size > next_start:  # pragma: no cover - unified pages rule this out
            raise InvalidConfigError(
                "KV-cache groups with different page sizes cannot share buffers"
            )
    tensors = [KVCacheTensor(size=size, shared_by=regions[(start, size)]) for start, size in starts]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups, kv_cache_tensors=tensors)


def max_memory_usage_bytes(
    kv_cache_specs: Iterable[KVCacheSpec],
    *,
    max_model_len: int,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int | None = None,
) -> int:
    """Sum of the specs' ``max_memory_usage_bytes``: the KV cache one request of
    ``max_model_len`` tokens needs, layer by layer (no group padding)."""
    sizing = _sizing(max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens)
    return sum(_spec_max_memory(spec, sizing) for spec in kv_cache_specs)


def _blocks_per_request(spec: KVCacheSpec, sizing: _Sizing) -> int:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.max_memory_usage_pages(
            sizing.max_model_len,
            sizing.max_in_flight_tokens,
            max_num_encoder_input_tokens=sizing.max_num_encoder_input_tokens,
        )
    return cdiv(_spec_max_memory(spec, sizing), spec.page_size_bytes)


def _max_memory_usage_bytes_from_groups(groups: list[KVCacheGroupSpec], sizing: _Sizing) -> int:
    """Memory one request needs in the pool: the blocks every group needs, each
    costing ``bytes_per_block`` (so padding layers count)."""
    total_blocks = sum(_blocks_per_request(g.kv_cache_spec, sizing) for g in groups)
    return _bytes_per_block(groups) * total_blocks


def _binary_search_max_model_len(upper: int, fits: Callable[[int], bool]) -> int:
    if not fits(1):
        return 0
    left, right, result = 1, upper, 1
    while left <= right:
        mid = (left + right) // 2
        if fits(mid):
            result, left = mid, mid + 1
        else:
            right = mid - 1
    return result


def estimate_max_model_len(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int | None = None,
) -> int:
    """The largest model length (at most ``max_model_len``) whose request fits in
    ``available_memory``, by binary search over :func:`max_memory_usage_bytes`; 0
    if even one token does not fit. ``max_in_flight_tokens`` stays fixed (``None``:
    the model length tried)."""
    specs = _check_specs(kv_cache_specs)
    sizing = _sizing(max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens)
    _check_int("available_memory", available_memory, minimum=0)

    def fits(model_len: int) -> bool:
        s = sizing.with_max_model_len(model_len)
        return sum(_spec_max_memory(spec, s) for spec in specs.values()) <= available_memory

    return _binary_search_max_model_len(max_model_len, fits)


def _raise_if_not_enough_memory(
    available_memory: int,
    needed_memory: Callable[[], int],
    max_model_len: int,
    estimate: Callable[[int], int],
) -> None:
    if available_memory <= 0:
        raise NotEnoughKVCacheMemoryError(
            f"No available memory for the cache blocks ({available_memory} bytes left for them).",
            max_model_len=max_model_len,
            needed_memory=needed_memory(),
            available_memory=available_memory,
            estimated_max_model_len=0,
        )
    needed = needed_memory()
    if needed <= available_memory:
        return
    estimated = estimate(available_memory)
    estimated_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimated}. "
        if estimated > 0
        else ""
    )
    raise NotEnoughKVCacheMemoryError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"{_format_gib(needed)} GiB ({needed} bytes) KV cache is needed, which is larger "
        f"than the available KV cache memory ({_format_gib(available_memory)} GiB, "
        f"{available_memory} bytes). {estimated_msg}Try increasing the memory for the KV "
        "cache or decreasing max_model_len.",
        max_model_len=max_model_len,
        needed_memory=needed,
        available_memory=available_memory,
        estimated_max_model_len=estimated,
    )


def check_enough_kv_cache_memory(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int | None = None,
) -> None:
    """Raise :class:`NotEnoughKVCacheMemoryError` unless ``available_memory`` holds
    one request of ``max_model_len`` tokens plus the null block (vLLM's public
    ``check_enough_kv_cache_memory``: per-layer sums, no group padding;
    :func:`get_kv_cache_config` checks with group padding)."""
    specs = _check_specs(kv_cache_specs)
    sizing = _sizing(max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens)
    _check_int("available_memory", available_memory, minimum=0)
    if not specs:
        return
    check_memory = available_memory - _bytes_per_block(get_kv_cache_groups(specs))
    _raise_if_not_enough_memory(
        check_memory,
        lambda: sum(_spec_max_memory(spec, sizing) for spec in specs.values()),
        max_model_len,
        lambda mem: estimate_max_model_len(
            specs,
            mem,
            max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
        ),
    )


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int | None = None,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """The KV-cache config of a model with ``kv_cache_specs`` (layer name -> spec, in
    model order) in ``available_memory`` bytes, as vLLM 0.33's
    ``get_kv_cache_configs`` builds it for one worker.

    ``num_gpu_blocks_override`` fixes the block count (and the memory checked is
    then ``override * bytes_per_block``). Raises :class:`NotEnoughKVCacheMemoryError`
    (an ``InvalidConfigError``) when the memory, less one block for the null block,
    cannot hold one request of ``max_model_len`` tokens; the message gives the
    needed and available bytes and the longest model length that fits.
    """
    specs = _check_specs(kv_cache_specs)
    sizing = _sizing(max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens)
    _check_int("available_memory", available_memory, minimum=0)
    if num_gpu_blocks_override is not None:
        _check_int("num_gpu_blocks_override", num_gpu_blocks_override, minimum=1)
    if not specs:
        raise InvalidConfigError(
            "the model has no KV-cache layers: an attention-free model needs no KV-cache manager"
        )
    groups = get_kv_cache_groups(specs)
    bytes_per_block = _bytes_per_block(groups)
    if num_gpu_blocks_override is not None:
        available_memory = num_gpu_blocks_override * bytes_per_block

    def estimate(mem: int) -> int:
        return _binary_search_max_model_len(
            max_model_len,
            lambda n: (
                _max_memory_usage_bytes_from_groups(groups, sizing.with_max_model_len(n)) <= mem
            ),
        )

    _raise_if_not_enough_memory(
        available_memory - bytes_per_block,
        lambda: _max_memory_usage_bytes_from_groups(groups, sizing),
        max_model_len,
        estimate,
    )
    return get_kv_cache_config_from_groups(
        groups, available_memory, num_gpu_blocks_override=num_gpu_blocks_override
    )


def get_max_concurrency_for_kv_cache_config(
    kv_cache_config: KVCacheConfig,
    *,
    max_model_len: int,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int | None = None,
) -> float:
    """How many requests of ``max_model_len`` tokens fit at once:
    ``num_blocks / sum over groups of cdiv(spec max memory, spec page)``."""
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise TypeError(f"expected a KVCacheConfig, got {kv_cache_config!r}")
    sizing = _sizing(max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens)
    blocks_per_request = sum(
        cdiv(_spec_max_memory(g.kv_cache_spec, sizing), g.kv_cache_spec.page_size_bytes)
        for g in kv_cache_config.kv_cache_groups
    )
    return kv_cache_config.num_blocks / blocks_per_request


def get_kv_cache_capacity(
    kv_cache_config: KVCacheConfig,
    *,
    max_model_len: int,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int | None = None,
) -> tuple[int, float]:
    """``(tokens, max concurrency)``: the KV-cache capacity in tokens of
    ``max_model_len`` requests (``int(concurrency * max_model_len)``) and the
    concurrency of :func:`get_max_concurrency_for_kv_cache_config`."""
    concurrency = get_max_concurrency_for_kv_cache_config(
        kv_cache_config,
        max_model_len=max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens,
    )
    return int(concurrency * max_model_len), concurrency
