//! Criterion benches of every hot path of the core.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pagedkv_benches::{admit, manager, tokens};
use pagedkv_core::{AllocateArgs, BlockHash, BlockHasher, BlockPool, CacheKey, Eviction, HashAlgo};

fn free_queue(c: &mut Criterion) {
    let mut g = c.benchmark_group("free_queue");
    for n in [1u32, 16, 256] {
        g.bench_with_input(BenchmarkId::new("get_then_free", n), &n, |b, &n| {
            let mut pool = BlockPool::new(1 << 16, true, false);
            let mut out = Vec::with_capacity(n as usize);
            b.iter(|| {
                out.clear();
                pool.get_new_blocks(n, &mut out);
                pool.free_blocks(out.iter().rev().copied());
            });
        });
    }
    // The same under the other device eviction policies.
    for policy in [Eviction::Arc, Eviction::Slru] {
        for n in [1u32, 16, 256] {
            let name = format!("get_then_free_{}", policy.name());
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, &n| {
                let mut pool = BlockPool::new(1 << 16, true, false).with_eviction(policy);
                let mut out = Vec::with_capacity(n as usize);
                b.iter(|| {
                    out.clear();
                    pool.get_new_blocks(n, &mut out);
                    pool.free_blocks(out.iter().rev().copied());
                });
            });
        }
    }
    g.finish();
}

/// The pool's allocate / cache / hit / free cycle under each eviction
/// policy, the cache full: every call evicts `n` cached blocks, caches them
/// afresh, hits half of them (a second reference) and frees all, tail first.
fn eviction(c: &mut Criterion) {
    let mut g = c.benchmark_group("eviction");
    let keys: Vec<CacheKey> = (0u32..1 << 18)
        .map(|i| {
            let mut d = [0u8; 32];
            d[..4].copy_from_slice(&i.to_le_bytes());
            d[4..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9).to_le_bytes());
            CacheKey {
                hash: BlockHash::from_slice(&d).expect("a 32-byte digest"),
                group: 0,
            }
        })
        .collect();
    for policy in Eviction::ALL {
        let n = 16usize;
        g.bench_function(BenchmarkId::new("cached_cycle_16", policy.name()), |b| {
            let mut pool = BlockPool::new(1 << 16, true, false).with_eviction(policy);
            let mut out = Vec::with_capacity(n);
            let mut k = 0usize;
            b.iter(|| {
                out.clear();
                pool.get_new_blocks(n as u32, &mut out);
                for &id in &out {
                    pool.cache_block(id, keys[k]);
                    k = (k + 1) % keys.len();
                }
                pool.touch(&out[..n / 2]);
                pool.free_blocks(out[..n / 2].iter().rev().copied());
                pool.free_blocks(out.iter().rev().copied());
            });
        });
    }
    g.finish();
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash_block_16_tokens");
    let toks = tokens(1, 16, 32000);
    for algo in [
        HashAlgo::Sha256Cbor,
        HashAlgo::XxhashCbor,
        HashAlgo::Xxh3Native,
    ] {
        let mut h = BlockHasher::new(algo, algo.none_hash("bench"));
        let parent = h.hash_block(None, &toks, &[]);
        g.throughput(Throughput::Bytes(64));
        g.bench_function(algo.name(), |b| {
            b.iter(|| black_box(h.hash_block(Some(&parent), black_box(&toks), &[])));
        });
    }
    // A prompt's chain: each block's parent is the hash just computed, so no
    // two hashes overlap (what add_request does), per block.
    let chain: Vec<Vec<u32>> = (0..64).map(|i| tokens(100 + i, 16, 32000)).collect();
    let mut h = BlockHasher::new(
        HashAlgo::Sha256Cbor,
        HashAlgo::Sha256Cbor.none_hash("bench"),
    );
    g.throughput(Throughput::Bytes(64 * 64));
    g.bench_function("sha256_cbor_chained_64_blocks", |b| {
        b.iter(|| {
            let mut parent = None;
            for block in &chain {
                parent = Some(h.hash_block(parent.as_ref(), black_box(block), &[]));
            }
            black_box(parent)
        });
    });
    g.throughput(Throughput::Bytes(64));
    // The digest alone over a message of the size a 16-token sha256_cbor block
    // encodes to (tokens < 65,536: 2 + 34 + 1 + 16 * 3 + 1 bytes): the core's
    // direct compression, and sha2's Digest API (hasher object, buffering).
    let msg = vec![0x5au8; 86];
    g.bench_function("sha256_digest_only_86_bytes", |b| {
        b.iter(|| black_box(pagedkv_core::hash::sha256_bytes(black_box(&msg))));
    });
    g.bench_function("sha256_digest_api_86_bytes", |b| {
        use sha2::Digest;
        b.iter(|| black_box(sha2::Sha256::digest(black_box(&msg))));
    });
    g.finish();
}

fn lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("get_computed_blocks_2560_tokens");
    let prompt = tokens(7, 2560, 32000);
    let mut mgr = manager(4096);
    assert!(admit(&mut mgr, "cached", &prompt));
    let mut p2 = prompt.clone();
    p2.push(1);
    let _ = mgr.add_request(
        "hit",
        pagedkv_core::RequestSpec {
            prompt_token_ids: p2,
            ..Default::default()
        },
    );
    let _ = mgr.add_request(
        "miss",
        pagedkv_core::RequestSpec {
            prompt_token_ids: tokens(8, 2561, 32000),
            ..Default::default()
        },
    );
    g.bench_function("hit_160_blocks", |b| {
        b.iter(|| {
            black_box(
                mgr.get_computed_blocks("hit")
                    .map(|h| h.num_computed_tokens),
            )
        });
    });
    g.bench_function("miss", |b| {
        b.iter(|| {
            black_box(
                mgr.get_computed_blocks("miss")
                    .map(|h| h.num_computed_tokens),
            )
        });
    });
    g.finish();
}

fn allocate(c: &mut Criterion) {
    let mut g = c.benchmark_group("allocate_slots");
    // Decode step of a running request that needs no new block (15 of 16 steps).
    let mut mgr = manager(1 << 16);
    let prompt = tokens(3, 1000, 32000);
    assert!(admit(&mut mgr, "r", &prompt));
    g.bench_function("decode_no_new_block", |b| {
        let args = AllocateArgs::step(1, 999);
        b.iter(|| black_box(mgr.allocate_slots("r", &args, None).map(|x| x.is_some())));
    });
    // Admission of a 2,560-token prompt (160 fresh blocks) and its release.
    let prompt = tokens(4, 2560, 32000);
    let mut mgr = manager(1 << 16);
    let mut i = 0u64;
    g.bench_function("admit_2560_then_remove", |b| {
        b.iter(|| {
            let id = format!("a{i}");
            i += 1;
            let mut p = prompt.clone();
            p[0] = (i % 30000) as u32; // distinct content: no hits
            assert!(admit(&mut mgr, &id, &p));
            let _ = mgr.remove_request(&id);
        });
    });
    g.finish();
}

/// Lookup and decode step with 1–4 KV-cache groups (full attention plus sliding
/// windows: the hybrid coordinator from 2 groups on).
fn coordinator(c: &mut Criterion) {
    use pagedkv_core::{AttentionKind, GroupSpec, KvCacheManager, ManagerConfig, RequestSpec};
    let mut g = c.benchmark_group("coordinator_groups");
    for n in 1..=4usize {
        let mut cfg = ManagerConfig::full_attention(1 << 16, 16, 1 << 20);
        cfg.groups = (0..n)
            .map(|i| {
                let kind = if i == 0 {
                    AttentionKind::FullAttention
                } else {
                    AttentionKind::SlidingWindow {
                        window: 512 * i as u32,
                    }
                };
                GroupSpec::new(kind, 16)
            })
            .collect();
        let Ok(mut mgr) = KvCacheManager::new(cfg) else {
            continue;
        };
        let prompt = tokens(9, 2560, 32000);
        assert!(admit(&mut mgr, "cached", &prompt));
        let mut p2 = prompt.clone();
        p2.push(1);
        let _ = mgr.add_request(
            "hit",
            RequestSpec {
                prompt_token_ids: p2,
                ..Default::default()
            },
        );
        g.bench_with_input(BenchmarkId::new("lookup_2560_tokens", n), &n, |b, _| {
            b.iter(|| {
                black_box(
                    mgr.get_computed_blocks("hit")
                        .map(|h| h.num_computed_tokens),
                )
            });
        });
        g.bench_with_input(BenchmarkId::new("decode_step", n), &n, |b, _| {
            let args = AllocateArgs::step(1, 2559);
            b.iter(|| {
                black_box(
                    mgr.allocate_slots("cached", &args, None)
                        .map(|x| x.is_some()),
                )
            });
        });
    }
    g.finish();
}

/// A whole trace replayed through the pure-Rust floor of the scheduler loop
/// (`pagedkv_benches::floor`, the loop of `benches/drive_bench.py` without Python):
/// the oracle's trace cut to 200 requests.
fn trace_replay(c: &mut Criterion) {
    let reqs = pagedkv_benches::trace::generate(0, 200);
    let mut g = c.benchmark_group("trace_replay");
    g.sample_size(10);
    g.bench_function("200_requests_4096_blocks", |b| {
        b.iter(|| {
            let mut cfg = pagedkv_core::ManagerConfig::full_attention(4096, 16, 16384);
            cfg.max_in_flight_tokens = Some(8192);
            let Ok(mut kv) = pagedkv_core::KvCacheManager::new(cfg) else {
                return;
            };
            black_box(pagedkv_benches::floor::run(&mut kv, &reqs, false));
        });
    });
    for policy in [Eviction::Arc, Eviction::Slru] {
        let name = format!("200_requests_4096_blocks_{}", policy.name());
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut cfg = pagedkv_core::ManagerConfig::full_attention(4096, 16, 16384);
                cfg.max_in_flight_tokens = Some(8192);
                cfg.eviction = policy;
                let Ok(mut kv) = pagedkv_core::KvCacheManager::new(cfg) else {
                    return;
                };
                black_box(pagedkv_benches::floor::run(&mut kv, &reqs, false));
            });
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    free_queue,
    eviction,
    hashing,
    lookup,
    allocate,
    coordinator,
    trace_replay
);
criterion_main!(benches);
