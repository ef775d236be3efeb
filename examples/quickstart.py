"""pagedkv quickstart: two requests sharing a system prompt, prefix caching, decode,
preemption and the KV events a router would consume."""

import numpy as np
import pagedkv as pk

spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16")
config = pk.KVCacheConfig(num_blocks=64, kv_cache_groups=[pk.KVCacheGroupSpec(["layer.0"], spec)])
mgr = pk.KVCacheManager(config, max_model_len=4096, log_stats=True, enable_kv_cache_events=True)
print(mgr, f"- {spec.page_size_bytes} bytes per block per layer")

rng = np.random.default_rng(0)
system = rng.integers(0, 32000, size=100).tolist()  # a shared 100-token system prompt


def admit(rid: str, prompt: list[int]) -> None:
    mgr.add_request(rid, prompt)
    hit = mgr.get_computed_blocks(rid)  # longest cached prefix (no refs taken)
    new = mgr.allocate_slots(
        rid, len(prompt) - hit.num_computed_tokens, num_computed_tokens=0, new_computed_blocks=hit
    )
    assert new is not None, "no room"
    print(
        f"{rid}: {len(prompt)} tokens, prefix hit {hit.num_computed_tokens} tokens "
        f"{hit.block_ids[0].tolist()}, new blocks {new[0].tolist()}"
    )


admit("a", system + rng.integers(0, 32000, size=30).tolist())
admit("b", system + rng.integers(0, 32000, size=50).tolist())

# Decode 20 tokens for both: append the sampled token, then one crossing per step
# gives every running request the slot for it.
for _ in range(20):
    ids = ["a", "b"]
    for r in ids:
        mgr.append_token_ids(r, [int(rng.integers(0, 32000))])
    computed = np.array([mgr.num_tokens(r) - 1 for r in ids])
    n_ok, groups = mgr.allocate_slots_batch(ids, 1, computed)
    block_ids, offsets = groups[0]
    assert n_ok == len(ids)
print("after decode:", {r: mgr.get_block_ids(r)[0].tolist() for r in ("a", "b")})

mgr.free("b")  # preempt b: blocks back to the pool
print(f"free blocks {mgr.num_free_blocks}, usage {mgr.usage:.2f}")
hit = mgr.get_computed_blocks("b")  # b's own blocks are still cached
print(f"b re-lookup hits {hit.num_computed_tokens} of {mgr.num_tokens('b')} tokens")
mgr.remove_request("a")
mgr.remove_request("b")

events = mgr.take_events()
print(f"{len(events)} events:", [(type(e).__name__, len(e.block_hashes)) for e in events])
print(mgr.make_prefix_cache_stats())
mgr.check_invariants()
