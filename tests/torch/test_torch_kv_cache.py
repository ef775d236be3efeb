"""KV-cache tensors of a config: layouts, buffer sharing between groups, Mamba
states carved from pages, padded pages, and errors."""

from __future__ import annotations

import subprocess
import sys

import pagedkv as pk
import pytest

torch = pytest.importorskip("torch")

from pagedkv.torch import TinyConfig, TinyTransformer, allocate_kv_cache, torch_dtype  # noqa: E402

torch.set_num_threads(1)


def _hybrid_config(num_blocks: int = 32) -> pk.KVCacheConfig:
    model = TinyTransformer(TinyConfig(layer_types=("full", "sliding", "full", "sliding")))
    return pk.get_kv_cache_config(
        model.kv_cache_specs(4), 0, max_model_len=32, num_gpu_blocks_override=num_blocks
    )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) that a view can touch."""
    start = t.data_ptr()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + extent * t.element_size()


def test_importing_pagedkv_does_not_import_torch() -> None:
    code = "import sys, pagedkv; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attention_layout_and_dtype() -> None:
    spec = pk.FullAttentionSpec(4, 2, 8, "bfloat16")
    config = pk.KVCacheConfig(
        num_blocks=10,
        kv_cache_groups=[pk.KVCacheGroupSpec(["a", "b"], spec)],
        kv_cache_tensors=[
            pk.KVCacheTensor(spec.page_size_bytes * 10, ["a"]),
            pk.KVCacheTensor(spec.page_size_bytes * 10, ["b"]),
        ],
    )
    cache = allocate_kv_cache(config, "cpu")
    assert cache.device.type == "cpu"
    assert len(cache.buffers) == 2
    for name in ("a", "b"):
        kv = cache[name]
        assert isinstance(kv, torch.Tensor)
        assert kv.shape == (2, 10, 4, 2, 8) and kv.dtype == torch.bfloat16
        assert kv.is_contiguous()
    assert cache.buffers[0].numel() == spec.page_size_bytes * 10


def test_hybrid_groups_share_buffers_as_the_config_says() -> None:
    config = _hybrid_config()
    assert len(config.kv_cache_groups) == 2
    cache = allocate_kv_cache(config, "cpu")
    assert len(cache.buffers) == len(config.kv_cache_tensors) == 2
    group_of = {n: g for g, grp in enumerate(config.kv_cache_groups) for n in grp.layer_names}
    for tensor, raw in zip(config.kv_cache_tensors, cache.buffers, strict=True):
        a, b = tensor.shared_by
        assert group_of[a] != group_of[b]
        ka, kb = cache[a], cache[b]
        assert isinstance(ka, torch.Tensor) and isinstance(kb, torch.Tensor)
        # One storage, the same bytes: a write through one layer shows in the other.
        assert ka.untyped_storage().data_ptr() == kb.untyped_storage().data_ptr() == raw.data_ptr()
        assert _span(ka) == _span(kb)
        ka[1, 5].fill_(3.25)
        assert torch.equal(kb[1, 5], torch.full_like(kb[1, 5], 3.25))
        assert int(kb.count_nonzero()) == kb[1, 5].numel()
    for group in config.kv_cache_groups:
        spans = [_span(cache[n]) for n in group.layer_names]  # type: ignore[arg-type]
        for i, (s0, e0) in enumerate(spans):
            for s1, e1 in spans[i + 1 :]:
                assert e0 <= s1 or e1 <= s0, "layers of one group overlap"
        ptrs = {cache[n].untyped_storage().data_ptr() for n in group.layer_names}  # type: ignore[union-attr]
        assert len(ptrs) == len(group.layer_names)


def test_mla_latent_layout() -> None:
    spec = pk.MLAAttentionSpec(8, 1, 24, "float16")
    config = pk.KVCacheConfig(num_blocks=6, kv_cache_groups=[pk.KVCacheGroupSpec(["m"], spec)])
    cache = allocate_kv_cache(config, "cpu")
    latent = cache["m"]
    assert isinstance(latent, torch.Tensor)
    assert latent.shape == (6, 8, 24) and latent.dtype == torch.float16
    assert cache.layers["m"].block_tensors[0] is latent
    assert cache.buffers[0].numel() == 6 * spec.page_size_bytes


def test_mamba_states_are_carved_from_pages() -> None:
    spec = pk.MambaSpec(16, ((3, 4), (2, 5)), ("float32", "float16"), page_size_padded=96)
    assert spec.real_page_size_bytes == 3 * 4 * 4 + 2 * 5 * 2  # 68
    config = pk.KVCacheConfig(num_blocks=5, kv_cache_groups=[pk.KVCacheGroupSpec(["s"], spec)])
    cache = allocate_kv_cache(config, "cpu")
    conv, ssm = cache["s"]  # type: ignore[misc]
    assert conv.shape == (5, 3, 4) and conv.dtype == torch.float32
    assert ssm.shape == (5, 2, 5) and ssm.dtype == torch.float16
    x = torch.arange(12, dtype=torch.float32).view(3, 4) + 1
    y = torch.arange(10, dtype=torch.float16).view(2, 5) - 4
    conv[3] = x
    ssm[3] = y
    pages = cache.buffers[0].view(5, 96)
    assert torch.equal(pages[3, :48].view(torch.float32).view(3, 4), x)
    assert torch.equal(pages[3, 48:68].view(torch.float16).view(2, 5), y)
    assert int(pages[3, 68:].count_nonzero()) == 0  # padding untouched
    assert int(pages[[0, 1, 2, 4]].count_nonzero()) == 0  # other blocks untouched


def test_padded_attention_page_keeps_blocks_apart() -> None:
    spec = pk.FullAttentionSpec(2, 1, 4, "float32", page_size_padded=128)
    assert spec.real_page_size_bytes == 64
    config = pk.KVCacheConfig(num_blocks=4, kv_cache_groups=[pk.KVCacheGroupSpec(["a"], spec)])
    cache = allocate_kv_cache(config, "cpu")
    kv = cache["a"]
    assert isinstance(kv, torch.Tensor) and kv.shape == (2, 4, 2, 1, 4)
    kv[0, 2] = 1.0
    kv[1, 2] = 2.0
    pages = cache.buffers[0].view(4, 128)
    assert torch.equal(pages[2, :32].view(torch.float32), torch.ones(8))
    assert torch.equal(pages[2, 32:64].view(torch.float32), torch.full((8,), 2.0))
    assert int(pages[2, 64:].count_nonzero()) == 0
    assert int(pages[[0, 1, 3]].count_nonzero()) == 0


def test_uniform_type_group_gives_each_layer_its_shape() -> None:
    specs: dict[str, pk.KVCacheSpec] = {
        "a": pk.FullAttentionSpec(4, 2, 8, "float32"),
        "b": pk.FullAttentionSpec(4, 4, 8, "float32"),
    }
    config = pk.get_kv_cache_config(specs, 0, max_model_len=32, num_gpu_blocks_override=12)
    assert len(config.kv_cache_groups) == 1
    cache = allocate_kv_cache(config, "cpu")
    assert cache["a"].shape == (2, 12, 4, 2, 8)  # type: ignore[union-attr]
    assert cache["b"].shape == (2, 12, 4, 4, 8)  # type: ignore[union-attr]


def test_config_without_tensors_gets_one_buffer_per_layer() -> None:
    spec = pk.SlidingWindowSpec(4, 1, 8, "float32", sliding_window=8)
    config = pk.KVCacheConfig(
        num_blocks=7, kv_cache_groups=[pk.KVCacheGroupSpec(["x", "y", "z"], spec)]
    )
    cache = allocate_kv_cache(config, "cpu")
    assert len(cache.buffers) == 3
    assert [cache.layers[n].buffer_index for n in "xyz"] == [0, 1, 2]


def test_num_blocks_override_scales_every_buffer() -> None:
    config = _hybrid_config(32)
    cpu = allocate_kv_cache(config, "cpu", num_blocks=8)
    assert cpu.num_blocks == 8
    for tensor, raw in zip(config.kv_cache_tensors, cpu.buffers, strict=True):
        assert raw.numel() == tensor.size // 4
    assert cpu["layers.0.attn"].shape[1] == 8  # type: ignore[union-attr]


def test_zero_filled() -> None:
    cache = allocate_kv_cache(_hybrid_config(), "cpu")
    assert all(int(b.count_nonzero()) == 0 for b in cache.buffers)


def test_bad_configs_raise() -> None:
    spec = pk.FullAttentionSpec(4, 1, 8, "float32")
    page = spec.page_size_bytes
    groups = [pk.KVCacheGroupSpec(["a", "b"], spec)]
    with pytest.raises(pk.InvalidConfigError, match="without a KV-cache tensor"):
        allocate_kv_cache(pk.KVCacheConfig(4, groups, [pk.KVCacheTensor(4 * page, ["a"])]), "cpu")
    with pytest.raises(pk.InvalidConfigError, match="unknown layer"):
        allocate_kv_cache(
            pk.KVCacheConfig(4, groups, [pk.KVCacheTensor(4 * page, ["a", "b", "c"])]), "cpu"
        )
    with pytest.raises(pk.InvalidConfigError, match="tensors 0 and 1"):
        allocate_kv_cache(
            pk.KVCacheConfig(
                4,
                groups,
                [pk.KVCacheTensor(4 * page, ["a", "b"]), pk.KVCacheTensor(4 * page, ["a"])],
            ),
            "cpu",
        )
    with pytest.raises(pk.InvalidConfigError, match="needs"):
        allocate_kv_cache(
            pk.KVCacheConfig(
                4, groups, [pk.KVCacheTensor(4 * page, ["a"]), pk.KVCacheTensor(2 * page, ["b"])]
            ),
            "cpu",
        )
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_cache(pk.KVCacheConfig(4, groups), "cpu", num_blocks=0)
    with pytest.raises(TypeError):
        allocate_kv_cache("not a config", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head_size_v"):
        odd = pk.FullAttentionSpec(4, 1, 8, "float32", head_size_v=4)
        allocate_kv_cache(pk.KVCacheConfig(4, [pk.KVCacheGroupSpec(["a"], odd)]), "cpu")


def test_torch_dtype_names() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("fp8") is torch.float8_e4m3fn
    assert torch_dtype(torch.float16) is torch.float16
    assert torch_dtype("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="no torch dtype"):
        torch_dtype("float128")
