//! The manager with a host tier: lookups past the device hit, loads reserved
//! at admission and published only once complete, stores of computed chunks,
//! requests freed mid-transfer, bad completions. Block ids follow vLLM's pool
//! (free queue order, tail-first frees); slots follow vLLM's CPU tier (fresh
//! slots first).

use pagedkv_core::{
    AllocateArgs, Error, KvCacheManager, ManagerConfig, OffloadConfig, TransferPlan, WritePolicy,
};

mod support;
use support::{add, admit_with_host as admit, prompt};

fn manager(num_blocks: u32, chunks: u64) -> KvCacheManager {
    let mut m = KvCacheManager::new(ManagerConfig::full_attention(num_blocks, 4, 256)).unwrap();
    m.enable_offload(OffloadConfig {
        bytes_per_block: 100,
        ..OffloadConfig::new(chunks)
    })
    .unwrap();
    m
}

fn only_store(plan: &TransferPlan) -> (u64, Vec<u32>, Vec<u64>) {
    assert!(plan.loads.is_empty());
    assert_eq!(plan.stores.len(), 1);
    let t = &plan.stores[0];
    (t.job, t.device_blocks.clone(), t.host_blocks.clone())
}

/// r0's 10 blocks stored, r1 evicts r0's tail from the pool; r2 (r0's
/// prompt and more) hits r0's head on the device and its tail in the tier.
fn evicted_tail() -> KvCacheManager {
    let mut m = manager(16, 64);
    add(&mut m, "r0", prompt(1, 40));
    assert_eq!(admit(&mut m, "r0").2, (1..=10).collect::<Vec<_>>());
    let (job, dev, host) = only_store(&m.take_transfer_plan().unwrap());
    assert_eq!((dev, host), ((1..=10).collect(), (0..10).collect()));
    m.complete_transfers(&[job], &[]).unwrap();
    m.remove_request("r0").unwrap();
    add(&mut m, "r1", prompt(2, 40));
    assert_eq!(
        admit(&mut m, "r1").2,
        vec![11, 12, 13, 14, 15, 10, 9, 8, 7, 6]
    );
    let (job, _, host) = only_store(&m.take_transfer_plan().unwrap());
    assert_eq!(host, (10..20).collect::<Vec<_>>());
    m.complete_transfers(&[job], &[]).unwrap();
    m.remove_request("r1").unwrap();
    m.check_invariants().unwrap();
    m
}

#[test]
fn host_hit_is_loaded_then_published() {
    let mut m = evicted_tail();
    let mut p2 = prompt(1, 40);
    p2.extend([7, 7, 7, 7]);
    add(&mut m, "r2", p2);
    let (dev, host, new) = admit(&mut m, "r2");
    assert_eq!((dev, host), (20, 20));
    // The blocks of the host hit are allocated with the hit, as vLLM
    // allocates external tokens' blocks; the new ones are listed.
    assert_eq!(new, vec![15]);
    assert_eq!(
        m.block_ids("r2").unwrap()[0],
        &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15]
    );
    let plan = m.take_transfer_plan().unwrap();
    assert_eq!(plan.loads.len(), 1);
    let load = &plan.loads[0];
    assert_eq!(load.request_id, "r2");
    assert_eq!(load.device_blocks, vec![6, 7, 8, 9, 10]);
    assert_eq!(load.host_blocks, vec![5, 6, 7, 8, 9]);
    assert!(
        plan.stores.is_empty(),
        "nothing of r2 is cached before its load"
    );

    // Not published before the load completes: r3 (r0's prompt) hits the
    // device head only, and the tier for the rest.
    add(&mut m, "r3", prompt(1, 40));
    let hit = m.get_computed_blocks("r3").unwrap();
    assert_eq!((hit.num_computed_tokens, hit.num_host_tokens), (20, 19));
    m.check_invariants().unwrap();

    assert!(m.complete_transfers(&[load.job], &[]).unwrap().is_empty());
    let hit = m.get_computed_blocks("r3").unwrap();
    assert_eq!(hit.block_ids[0], vec![1, 2, 3, 4, 5, 6, 7, 8, 9]);
    // The last chunk is loaded again for the three tokens before the last
    // (vLLM loads to the prompt's end and recomputes its last token).
    assert_eq!((hit.num_computed_tokens, hit.num_host_tokens), (36, 3));
    let s = m.offload_stats().unwrap();
    assert_eq!(
        (s.loads, s.loads_completed, s.blocks_loaded, s.bytes_loaded),
        (1, 1, 5, 500)
    );
    assert_eq!(
        (s.stores_completed, s.blocks_stored, s.bytes_stored),
        (2, 20, 2000)
    );
    m.check_invariants().unwrap();
}

#[test]
fn failed_load_is_never_published() {
    let mut m = evicted_tail();
    add(&mut m, "r2", prompt(1, 44));
    let (dev, host, _) = admit(&mut m, "r2");
    assert_eq!((dev, host), (20, 20));
    let job = m.take_transfer_plan().unwrap().loads[0].job;
    let failed = m.complete_transfers(&[], &[job]).unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(
        (failed[0].request_id.as_str(), failed[0].num_valid_tokens),
        ("r2", 20)
    );
    add(&mut m, "r3", prompt(1, 40));
    let hit = m.get_computed_blocks("r3").unwrap();
    assert_eq!(hit.num_computed_tokens, 20);
    assert_eq!(m.offload_stats().unwrap().loads_failed, 1);
    m.check_invariants().unwrap();
}

#[test]
fn request_freed_mid_load_keeps_blocks_until_the_copy_ends() {
    let mut m = evicted_tail();
    add(&mut m, "r2", prompt(1, 44));
    admit(&mut m, "r2");
    let job = m.take_transfer_plan().unwrap().loads[0].job;
    let free_before = m.num_free_blocks();
    m.free("r2").unwrap();
    // The five blocks being written stay out of the free queue.
    assert_eq!(m.num_free_blocks(), free_before + 11 - 5);
    m.check_invariants().unwrap();
    assert!(m.complete_transfers(&[job], &[]).unwrap().is_empty());
    assert_eq!(m.num_free_blocks(), free_before + 11);
    let s = m.offload_stats().unwrap();
    assert_eq!(s.completions_after_free, 1);
    // Nothing of the load was published.
    add(&mut m, "r3", prompt(1, 40));
    assert_eq!(m.get_computed_blocks("r3").unwrap().num_computed_tokens, 20);
    m.check_invariants().unwrap();
}

#[test]
fn load_not_taken_is_cancelled_with_its_request() {
    let mut m = evicted_tail();
    add(&mut m, "r2", prompt(1, 44));
    admit(&mut m, "r2");
    let free_before = m.num_free_blocks();
    m.free("r2").unwrap();
    assert_eq!(m.num_free_blocks(), free_before + 11);
    assert_eq!(m.offload_stats().unwrap().loads_cancelled, 1);
    assert_eq!(m.take_transfer_plan().unwrap(), TransferPlan::default());
    assert_eq!(m.num_transfers_in_flight(), 0);
    // Its chunks are unpinned: the tier can evict every chunk.
    assert_eq!(m.offload_tier().unwrap().num_evictable(), 20);
    m.check_invariants().unwrap();
}

#[test]
fn store_source_blocks_stay_held_until_the_store_completes() {
    let mut m = manager(16, 64);
    add(&mut m, "r0", prompt(1, 40));
    admit(&mut m, "r0");
    let (job, dev, _) = only_store(&m.take_transfer_plan().unwrap());
    m.remove_request("r0").unwrap();
    assert_eq!(m.num_free_blocks(), 15 - dev.len() as u32);
    // The tier holds the chunks as being written: a hit is pending, not usable.
    add(&mut m, "r1", prompt(1, 44));
    assert_eq!(m.get_computed_blocks("r1").unwrap().num_host_tokens, 0);
    m.complete_transfers(&[job], &[]).unwrap();
    assert_eq!(m.num_free_blocks(), 15);
    assert_eq!(m.offload_stats().unwrap().completions_after_free, 1);
    m.check_invariants().unwrap();
}

#[test]
fn tier_eviction_follows_its_policy() {
    // 12 chunks: r1's 10 new chunks evict r0's 8 least recent (tail first
    // within a request, vLLM's LRU).
    let mut m = manager(16, 12);
    add(&mut m, "r0", prompt(1, 40));
    admit(&mut m, "r0");
    let (job, ..) = only_store(&m.take_transfer_plan().unwrap());
    m.complete_transfers(&[job], &[]).unwrap();
    m.remove_request("r0").unwrap();
    add(&mut m, "r1", prompt(2, 40));
    admit(&mut m, "r1");
    let (job, _, host) = only_store(&m.take_transfer_plan().unwrap());
    // Fresh slots first, then the freed ones last in first out: r0's chunks
    // 9 down to 2 were evicted.
    assert_eq!(host, vec![10, 11, 2, 3, 4, 5, 6, 7, 8, 9]);
    m.complete_transfers(&[job], &[]).unwrap();
    assert_eq!(m.offload_stats().unwrap().evictions, 8);
    m.remove_request("r1").unwrap();
    // r0's head is left in the tier: its first two chunks.
    let tier = m.offload_tier().unwrap();
    assert_eq!(tier.num_resident(), 12);
    m.check_invariants().unwrap();
}

#[test]
fn stale_host_hit_is_refused() {
    let mut m = evicted_tail();
    add(&mut m, "r2", prompt(1, 44));
    let hit = m.get_computed_blocks("r2").unwrap();
    assert_eq!(hit.num_host_tokens, 20);
    assert!(m.reset_offload());
    let args = AllocateArgs {
        num_new_computed_tokens: 20,
        num_external_computed_tokens: 20,
        ..AllocateArgs::step(4, 0)
    };
    let free = m.num_free_blocks();
    let err = m.allocate_slots("r2", &args, Some(&hit)).unwrap_err();
    assert!(matches!(err, Error::StaleComputedBlocks(_)), "{err:?}");
    assert_eq!(m.num_free_blocks(), free);
    // The host hit declined: the tokens are computed instead.
    let hit = m.get_computed_blocks("r2").unwrap();
    assert_eq!(hit.num_host_tokens, 0);
    let args = AllocateArgs {
        num_new_computed_tokens: 20,
        ..AllocateArgs::step(24, 0)
    };
    assert!(m.allocate_slots("r2", &args, Some(&hit)).unwrap().is_some());
    m.check_invariants().unwrap();
}

#[test]
fn bad_calls_change_nothing() {
    let mut m = evicted_tail();
    add(&mut m, "r2", prompt(1, 44));
    let hit = m.get_computed_blocks("r2").unwrap();
    // Part of the host hit: refused.
    let args = AllocateArgs {
        num_new_computed_tokens: 20,
        num_external_computed_tokens: 8,
        ..AllocateArgs::step(16, 0)
    };
    assert!(matches!(
        m.allocate_slots("r2", &args, Some(&hit)),
        Err(Error::InvalidArgument(_))
    ));
    // Not the whole device hit: refused.
    let args = AllocateArgs {
        num_new_computed_tokens: 16,
        num_external_computed_tokens: 20,
        ..AllocateArgs::step(8, 0)
    };
    assert!(matches!(
        m.allocate_slots("r2", &args, Some(&hit)),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.num_transfers_in_flight(), 0);
    admit(&mut m, "r2");
    // A job never planned, listed twice, or not taken yet.
    assert!(m.complete_transfers(&[99], &[]).is_err());
    assert!(
        m.complete_transfers(&[3], &[]).is_err(),
        "planned, not taken"
    );
    let job = m.take_transfer_plan().unwrap().loads[0].job;
    assert!(m.complete_transfers(&[job], &[job]).is_err());
    assert!(m.complete_transfers(&[job, 99], &[]).is_err());
    assert_eq!(m.num_transfers_in_flight(), 1);
    assert!(!m.reset_offload(), "transfers in flight");
    m.complete_transfers(&[job], &[]).unwrap();
    // A double completion.
    assert!(m.complete_transfers(&[job], &[]).is_err());
    m.check_invariants().unwrap();
}

#[test]
fn bad_configs_are_refused() {
    use pagedkv_core::{AttentionKind, GroupSpec};
    let mut m = KvCacheManager::new(ManagerConfig::full_attention(16, 4, 256)).unwrap();
    assert!(matches!(
        m.enable_offload(OffloadConfig::new(0)),
        Err(Error::InvalidConfig(_))
    ));
    let cfg = ManagerConfig::new(
        16,
        vec![
            GroupSpec::new(AttentionKind::FullAttention, 4),
            GroupSpec::new(AttentionKind::SlidingWindow { window: 8 }, 4),
        ],
        256,
    );
    let mut m = KvCacheManager::new(cfg).unwrap();
    assert!(matches!(
        m.enable_offload(OffloadConfig::new(8)),
        Err(Error::InvalidConfig(_))
    ));
    let mut m = KvCacheManager::new(ManagerConfig::full_attention(16, 4, 256)).unwrap();
    add(&mut m, "r0", prompt(1, 8));
    assert!(matches!(
        m.enable_offload(OffloadConfig::new(8)),
        Err(Error::InvalidConfig(_))
    ));
    let mut m = KvCacheManager::new(ManagerConfig::full_attention(16, 4, 256)).unwrap();
    assert!(m.take_transfer_plan().is_err());
    assert!(m.complete_transfers(&[], &[]).is_err());
}

/// A serving loop over shared prefixes with a small pool and a smaller tier,
/// copies that fail or complete a step late, preemptions: every block's
/// content is modelled (the block hash it was computed or loaded for), and
/// every device hit and every completed load is checked against the
/// request's own hashes: no KV is served that was not computed for it.
#[test]
#[allow(clippy::too_many_lines, clippy::type_complexity)]
fn random_serving_never_serves_wrong_kv() {
    use pagedkv_core::BlockHash;
    use std::collections::HashMap;
    let mut totals = [0u64; 8];
    // Seeds 16 to 23 write back at eviction instead of as computed; seeds 24
    // and up have a small host tier over a disk tier.
    for seed in 0..32u64 {
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut m = KvCacheManager::new(ManagerConfig::full_attention(28, 4, 256)).unwrap();
        let bpc = 1 + (seed % 2) as u32;
        let write_policy = if seed < 16 {
            WritePolicy::WriteThrough
        } else {
            WritePolicy::WriteBack { window: 6 }
        };
        let with_disk = seed >= 24;
        let disk_dir = std::env::temp_dir().join(format!(
            "pagedkv-random-serving-{}-{seed}",
            std::process::id()
        ));
        let disk = with_disk.then(|| {
            let _ = std::fs::remove_dir_all(&disk_dir);
            std::fs::create_dir_all(&disk_dir).unwrap();
            pagedkv_core::offload::DiskConfig {
                dir: Some(disk_dir.clone()),
                capacity_bytes: 2_000,
                chunk_bytes: 32 * u64::from(bpc),
                enable_events: false,
            }
        });
        let host_chunks = if with_disk { 10 } else { 24 };
        m.enable_offload(OffloadConfig {
            blocks_per_chunk: bpc,
            write_policy,
            disk,
            ..OffloadConfig::new(host_chunks / u64::from(bpc))
        })
        .unwrap();
        let mut device: HashMap<u32, BlockHash> = HashMap::new();
        let mut host: HashMap<u64, BlockHash> = HashMap::new();
        // request -> (computed tokens, tokens left to sample)
        let mut running: Vec<(String, u64, u32)> = Vec::new();
        let mut waiting: Vec<(String, u32)> = Vec::new();
        let mut late: Vec<(u64, bool, Vec<(Vec<u32>, Vec<u64>)>)> = Vec::new();
        let mut n_req = 0;
        let check_blocks =
            |m: &KvCacheManager, id: &str, ids: &[u32], device: &HashMap<u32, BlockHash>| {
                let hashes = m.block_hashes(id).unwrap();
                for (j, b) in ids.iter().enumerate() {
                    assert_eq!(
                        device.get(b),
                        Some(&hashes[j]),
                        "seed {seed}: block {b} of {id} at {j}"
                    );
                }
            };
        for _step in 0..120 {
            if next(3) == 0 && waiting.len() < 4 {
                let id = format!("q{n_req}");
                n_req += 1;
                let mut p = prompt(next(3) as u32, 8 + 4 * next(6) as u32);
                p.extend((0..next(6) as u32).map(|i| 50_000 + n_req * 10 + i));
                add(&mut m, &id, p);
                waiting.push((id, 1 + next(4) as u32));
            }
            m.new_step_starts();
            // Admissions.
            let mut admitted = Vec::new();
            while let Some((id, left)) = waiting.pop() {
                let hit = m.get_computed_blocks(&id).unwrap();
                check_blocks(&m, &id, &hit.block_ids[0][..], &device);
                let n = m.num_tokens(&id).unwrap() as u64;
                let dev = hit.num_computed_tokens;
                let host_t = if next(4) == 0 { 0 } else { hit.num_host_tokens };
                let args = AllocateArgs {
                    num_new_computed_tokens: dev,
                    num_external_computed_tokens: host_t,
                    ..AllocateArgs::step(n - dev - host_t, 0)
                };
                if m.allocate_slots(&id, &args, Some(&hit)).unwrap().is_none() {
                    waiting.push((id, left));
                    break;
                }
                admitted.push((id, dev + host_t, left, dev));
            }
            // Preempt one at random (before its step's allocation: blocks
            // cached for a step that never runs would hold no KV).
            if !running.is_empty() && next(8) == 0 {
                let (id, _, left) = running.remove(next(running.len() as u64) as usize);
                m.free(&id).unwrap();
                waiting.push((id, left));
            }
            // Running decodes.
            let mut sched: Vec<(String, u64, u64)> = Vec::new();
            let mut keep = Vec::new();
            for (id, computed, left) in std::mem::take(&mut running) {
                let args = AllocateArgs::step(1, computed);
                if m.allocate_slots(&id, &args, None).unwrap().is_some() {
                    sched.push((id.clone(), computed, 1));
                    keep.push((id, computed, left));
                } else {
                    m.free(&id).unwrap();
                    waiting.push((id, left));
                }
            }
            running = keep;
            let plan = m.take_transfer_plan().unwrap();
            // Disk reads into host memory, then loads before the forward
            // pass; some fail. A load whose disk read failed copies nothing.
            let mut unread = Vec::new();
            for t in &plan.disk_reads {
                let mut buf = vec![0u8; 32 * bpc as usize];
                if m.read_disk_chunk(t.job, &mut buf).unwrap() {
                    for (h, b) in t.host_blocks.iter().zip(buf.chunks(32)) {
                        host.insert(*h, BlockHash::from_slice(b).unwrap());
                    }
                } else {
                    unread.extend(t.load_job);
                }
            }
            let mut failed_loads = Vec::new();
            let mut done = Vec::new();
            let mut jobs: Vec<u64> = plan.loads.iter().map(|t| t.job).collect();
            jobs.dedup();
            for job in jobs {
                if next(5) == 0 || unread.contains(&job) {
                    failed_loads.push(job);
                    continue;
                }
                for t in plan.loads.iter().filter(|t| t.job == job) {
                    for (d, h) in t.device_blocks.iter().zip(&t.host_blocks) {
                        device.insert(*d, host[h]);
                    }
                }
                done.push(job);
            }
            let failed = m.complete_transfers(&done, &failed_loads).unwrap();
            for (id, computed, left, dev) in admitted {
                let computed = if failed.iter().any(|f| f.request_id == id) {
                    dev
                } else {
                    computed
                };
                let n = m.num_tokens(&id).unwrap() as u64;
                // Loaded blocks hold the request's KV.
                let blocks = m.block_ids(&id).unwrap()[0].to_vec();
                check_blocks(&m, &id, &blocks[..(computed / 4) as usize], &device);
                sched.push((id.clone(), computed, n - computed));
                running.push((id, computed, left));
            }
            // The forward pass writes every full block it completes.
            for (id, computed, n) in &sched {
                let blocks = m.block_ids(id).unwrap()[0].to_vec();
                let hashes = m.block_hashes(id).unwrap().to_vec();
                for j in (*computed / 4) as usize..((computed + n) / 4) as usize {
                    device.insert(blocks[j], hashes[j]);
                }
            }
            for r in &mut running {
                if let Some(s) = sched.iter().find(|s| s.0 == r.0) {
                    r.1 = s.1 + s.2;
                }
            }
            // Stores after it: copied now or a step late (their blocks stay held).
            let mut store_jobs: Vec<u64> = plan.stores.iter().map(|t| t.job).collect();
            store_jobs.dedup();
            for job in store_jobs {
                let copies = plan
                    .stores
                    .iter()
                    .filter(|t| t.job == job)
                    .map(|t| (t.device_blocks.clone(), t.host_blocks.clone()))
                    .collect();
                late.push((job, next(6) != 0, copies));
            }
            let mut now = Vec::new();
            let mut keep_late = Vec::new();
            for l in late.drain(..) {
                if next(2) == 0 {
                    keep_late.push(l);
                } else {
                    now.push(l);
                }
            }
            late = keep_late;
            let (mut ok, mut bad) = (Vec::new(), Vec::new());
            for (job, success, copies) in now {
                if success {
                    for (d, h) in copies {
                        for (d, h) in d.iter().zip(&h) {
                            host.insert(*h, device[d]);
                        }
                    }
                    ok.push(job);
                } else {
                    bad.push(job);
                }
            }
            m.complete_transfers(&ok, &bad).unwrap();
            // Chunks stored in host memory before this plan, written through.
            for t in &plan.disk_writes {
                let data: Vec<u8> = t
                    .host_blocks
                    .iter()
                    .flat_map(|h| host[h].as_bytes().to_vec())
                    .collect();
                m.write_disk_chunk(t.job, &data).unwrap();
            }
            // Now and then the disk loses a chunk's bytes.
            if with_disk && next(16) == 0 {
                let path = m.offload_disk().unwrap().path().unwrap().to_owned();
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                let len = f.metadata().unwrap().len();
                if len > 0 {
                    use std::os::unix::fs::FileExt;
                    f.write_all_at(&[0x5A; 16], next(len)).unwrap();
                }
            }
            // Sampling: one token each; finished requests leave.
            let mut keep = Vec::new();
            for (id, computed, left) in running {
                let n = m.num_tokens(&id).unwrap() as u64;
                if computed < n {
                    keep.push((id, computed, left));
                } else if left <= 1 {
                    m.remove_request(&id).unwrap();
                } else {
                    m.append_token_ids(&id, &[70_000 + next(3) as u32]).unwrap();
                    keep.push((id, computed, left - 1));
                }
            }
            running = keep;
            m.check_invariants().unwrap();
        }
        let s = m.offload_stats().unwrap();
        drop(m);
        if with_disk {
            std::fs::remove_dir_all(&disk_dir).unwrap();
        }
        let wb = seed >= 16;
        for (t, v) in totals.iter_mut().zip([
            s.loads_completed,
            s.loads_failed,
            s.evictions,
            s.completions_after_free,
            if wb { s.stores_completed } else { 0 },
            if wb { s.write_backs_missed } else { 0 },
            s.disk_reads_completed,
            s.disk_reads_failed,
        ]) {
            *t += v;
        }
    }
    // The loop went through every path it checks.
    assert!(totals.iter().all(|&t| t > 0), "{totals:?}");
}

fn write_back_manager(num_blocks: u32, chunks: u64, window: u32) -> KvCacheManager {
    let mut m = KvCacheManager::new(ManagerConfig::full_attention(num_blocks, 4, 256)).unwrap();
    m.enable_offload(OffloadConfig {
        write_policy: WritePolicy::WriteBack { window },
        ..OffloadConfig::new(chunks)
    })
    .unwrap();
    m
}

/// Every store of the plan, one chunk each: (request, device blocks, host blocks).
fn stores(plan: &TransferPlan) -> Vec<(String, Vec<u32>, Vec<u64>)> {
    plan.stores
        .iter()
        .map(|t| {
            (
                t.request_id.clone(),
                t.device_blocks.clone(),
                t.host_blocks.clone(),
            )
        })
        .collect()
}

fn complete_all(m: &mut KvCacheManager, plan: &TransferPlan) {
    let mut jobs: Vec<u64> = plan
        .loads
        .iter()
        .chain(&plan.stores)
        .map(|t| t.job)
        .collect();
    jobs.dedup();
    assert!(m.complete_transfers(&jobs, &[]).unwrap().is_empty());
}

#[test]
fn write_back_stores_freed_chunks_as_they_near_eviction() {
    let mut m = write_back_manager(16, 64, 16);
    add(&mut m, "r0", prompt(1, 40));
    assert_eq!(admit(&mut m, "r0").2, (1..=10).collect::<Vec<_>>());
    // Running: nothing is written.
    assert!(m.take_transfer_plan().unwrap().stores.is_empty());
    m.remove_request("r0").unwrap();
    assert_eq!(m.num_write_back_candidates(), 10);
    // Freed tail first, r0's blocks follow 11..15 in the free queue: its
    // chunks are written in the order the pool would evict them.
    let plan = m.take_transfer_plan().unwrap();
    let want: Vec<_> = (0..10u32)
        .map(|i| ("r0".to_owned(), vec![10 - i], vec![u64::from(i)]))
        .collect();
    assert_eq!(stores(&plan), want);
    assert_eq!(m.num_write_back_candidates(), 0);
    // The copies hold their blocks; done, they return to the queue's tail.
    assert_eq!(m.num_free_blocks(), 5);
    complete_all(&mut m, &plan);
    assert_eq!(m.num_free_blocks(), 15);
    // r1 evicts r0's tail from the device.
    add(&mut m, "r1", prompt(2, 40));
    assert_eq!(
        admit(&mut m, "r1").2,
        vec![11, 12, 13, 14, 15, 10, 9, 8, 7, 6]
    );
    assert!(m.take_transfer_plan().unwrap().stores.is_empty());
    m.remove_request("r1").unwrap();
    // r2 (r0's prompt and more): r0's head on the device, its tail in the
    // tier (chunk 5 in slot 4 ... chunk 9 in slot 0).
    let mut p2 = prompt(1, 40);
    p2.extend([7, 7, 7, 7]);
    add(&mut m, "r2", p2);
    let (dev, host, new) = admit(&mut m, "r2");
    assert_eq!((dev, host), (20, 20));
    assert_eq!(new, vec![15]);
    let plan = m.take_transfer_plan().unwrap();
    assert_eq!(plan.loads.len(), 1);
    assert_eq!(plan.loads[0].device_blocks, vec![6, 7, 8, 9, 10]);
    assert_eq!(plan.loads[0].host_blocks, vec![4, 3, 2, 1, 0]);
    // The same plan writes back r1's chunks now at the queue's head (blocks
    // 14 down to 11: its chunks 3 down to 0) into fresh slots.
    let want: Vec<_> = (0..4u32)
        .map(|i| ("r1".to_owned(), vec![14 - i], vec![10 + u64::from(i)]))
        .collect();
    assert_eq!(stores(&plan), want);
    complete_all(&mut m, &plan);
    m.check_invariants().unwrap();
    // r1's chunks 4..9 lost their blocks to r2 unwritten: counted as r2's
    // own cached chunks take those blocks over (the loaded 6..10; r2's last
    // block, 15, is not cached before its next step: r1's chunk 4 waits on).
    assert_eq!(m.offload_stats().unwrap().write_backs_missed, 0);
    m.remove_request("r2").unwrap();
    let s = m.offload_stats().unwrap();
    assert_eq!(s.write_backs_missed, 5);
    assert_eq!(m.num_write_back_candidates(), 11);
    assert_eq!(
        (s.stores, s.stores_completed, s.blocks_stored),
        (14, 14, 14)
    );
    m.check_invariants().unwrap();
}

#[test]
fn write_back_window_bounds_what_one_plan_writes() {
    // A window of 2 blocks: the free queue is 11 (never used), then r0's
    // blocks tail first, so only r0's last chunk (block 10) is written.
    let mut m = write_back_manager(12, 64, 2);
    add(&mut m, "r0", prompt(1, 40));
    admit(&mut m, "r0");
    m.remove_request("r0").unwrap();
    let plan = m.take_transfer_plan().unwrap();
    assert_eq!(stores(&plan), vec![("r0".to_owned(), vec![10], vec![0])]);
    complete_all(&mut m, &plan);
    assert_eq!(m.num_write_back_candidates(), 9);
    // r0's prompt again: 9 blocks on the device, the rest of its last chunk
    // from the tier (the chunk written back). Released before its load ran:
    // the load is cancelled, its 9 cached chunks are candidates again (block
    // 11 was to be published by the load).
    add(&mut m, "r1", prompt(1, 40));
    let (dev, host, _) = admit(&mut m, "r1");
    assert_eq!((dev, host), (36, 3));
    m.remove_request("r1").unwrap();
    assert_eq!(m.num_write_back_candidates(), 9);
    assert_eq!(m.offload_stats().unwrap().loads_cancelled, 1);
    let bad = OffloadConfig {
        blocks_per_chunk: 4,
        write_policy: WritePolicy::WriteBack { window: 3 },
        ..OffloadConfig::new(8)
    };
    let mut fresh = KvCacheManager::new(ManagerConfig::full_attention(16, 4, 256)).unwrap();
    assert!(matches!(
        fresh.enable_offload(bad),
        Err(Error::InvalidConfig(_))
    ));
    m.check_invariants().unwrap();
}
