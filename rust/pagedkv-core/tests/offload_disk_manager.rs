//! The manager's host tier with a disk tier below: chunks stored in host
//! memory are written through to disk; a host hit continues on disk, its
//! chunks read back into host memory (checksummed) before they are loaded; a
//! corrupt file fails the load, which is never published. Block ids follow
//! vLLM's pool, host slots vLLM's CPU tier (fresh slots first, freed ones
//! last in first out), disk contents are the bytes the engine wrote.

use std::collections::HashMap;
use std::path::PathBuf;

use pagedkv_core::offload::DiskConfig;
use pagedkv_core::{Error, KvCacheManager, ManagerConfig, OffloadConfig, TransferPlan};

mod support;
use support::{add, admit_with_host as admit, prompt};

const CHUNK: usize = 8;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pagedkv-disk-mgr-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn manager(d: &std::path::Path, host_chunks: u64) -> KvCacheManager {
    let mut m = KvCacheManager::new(ManagerConfig::full_attention(16, 4, 256)).unwrap();
    m.enable_offload(OffloadConfig {
        disk: Some(DiskConfig {
            dir: Some(d.to_owned()),
            capacity_bytes: 1 << 20,
            chunk_bytes: CHUNK as u64,
            enable_events: false,
        }),
        ..OffloadConfig::new(host_chunks)
    })
    .unwrap();
    m
}

/// What every device block and host block holds: (prompt seed, block index).
#[derive(Default)]
struct Model {
    device: HashMap<u32, (u32, usize)>,
    host: HashMap<u64, (u32, usize)>,
}

fn bytes(c: (u32, usize)) -> [u8; CHUNK] {
    let mut b = [0u8; CHUNK];
    b[..4].copy_from_slice(&c.0.to_le_bytes());
    b[4..].copy_from_slice(&(c.1 as u32).to_le_bytes());
    b
}

impl Model {
    fn computed(&mut self, m: &KvCacheManager, id: &str, seed: u32) {
        for (i, &b) in m.block_ids(id).unwrap()[0].iter().enumerate() {
            self.device.insert(b, (seed, i));
        }
    }

    /// Runs a plan: disk reads, loads, stores, disk writes; every job done.
    /// Returns the disk reads that failed.
    fn run(&mut self, m: &mut KvCacheManager, plan: &TransferPlan) -> Vec<u64> {
        let mut failed_reads = Vec::new();
        for t in &plan.disk_reads {
            let mut buf = [0u8; CHUNK];
            if m.read_disk_chunk(t.job, &mut buf).unwrap() {
                let seed = u32::from_le_bytes(buf[..4].try_into().unwrap());
                let i = u32::from_le_bytes(buf[4..].try_into().unwrap()) as usize;
                self.host.insert(t.host_blocks[0], (seed, i));
            } else {
                failed_reads.push(t.load_job.unwrap());
            }
        }
        let mut done = Vec::new();
        for t in plan.loads.iter().chain(&plan.stores) {
            let to_device = plan.loads.contains(t);
            for (d, h) in t.device_blocks.iter().zip(&t.host_blocks) {
                if to_device {
                    if !failed_reads.contains(&t.job) {
                        self.device.insert(*d, self.host[h]);
                    }
                } else {
                    self.host.insert(*h, self.device[d]);
                }
            }
            done.push(t.job);
        }
        done.dedup();
        m.complete_transfers(&done, &[]).unwrap();
        for t in &plan.disk_writes {
            assert!(
                m.write_disk_chunk(t.job, &bytes(self.host[&t.host_blocks[0]]))
                    .unwrap()
            );
        }
        failed_reads
    }
}

/// r0 stored to host and disk, r1 to host (evicting r0 there) and disk; r0's
/// tail is gone from the device and host memory, on disk only.
fn on_disk_only(d: &std::path::Path) -> (KvCacheManager, Model) {
    let mut m = manager(d, 10);
    let mut model = Model::default();
    add(&mut m, "r0", prompt(1, 40));
    admit(&mut m, "r0");
    model.computed(&m, "r0", 1);
    let plan = m.take_transfer_plan().unwrap();
    assert_eq!(plan.stores[0].host_blocks, (0..10).collect::<Vec<_>>());
    model.run(&mut m, &plan);
    m.remove_request("r0").unwrap();
    // The completed store is written through: the next plan's disk writes.
    let plan = m.take_transfer_plan().unwrap();
    assert_eq!(plan.disk_writes.len(), 10);
    assert!(plan.disk_writes.iter().all(|t| t.load_job.is_none()));
    model.run(&mut m, &plan);
    add(&mut m, "r1", prompt(2, 40));
    assert_eq!(
        admit(&mut m, "r1").2,
        vec![11, 12, 13, 14, 15, 10, 9, 8, 7, 6]
    );
    model.computed(&m, "r1", 2);
    let plan = m.take_transfer_plan().unwrap();
    model.run(&mut m, &plan);
    let plan = m.take_transfer_plan().unwrap();
    model.run(&mut m, &plan);
    m.remove_request("r1").unwrap();
    let s = m.offload_stats().unwrap();
    assert_eq!((s.disk_writes_completed, s.evictions), (20, 10));
    assert_eq!(m.offload_disk().unwrap().len(), 20);
    m.check_invariants().unwrap();
    (m, model)
}

#[test]
fn a_prefix_on_disk_is_read_back_through_host_memory() {
    let d = dir("promote");
    let (mut m, mut model) = on_disk_only(&d);
    add(&mut m, "r2", {
        let mut p = prompt(1, 40);
        p.extend([7, 7, 7, 7]);
        p
    });
    let (dev, host, _) = admit(&mut m, "r2");
    assert_eq!((dev, host), (20, 20));
    let plan = m.take_transfer_plan().unwrap();
    assert_eq!(plan.disk_reads.len(), 5);
    let (load,) = (&plan.loads[0],);
    assert_eq!(load.device_blocks, vec![6, 7, 8, 9, 10]);
    // Each disk read fills the host block its load reads.
    let read_blocks: Vec<u64> = plan.disk_reads.iter().map(|t| t.host_blocks[0]).collect();
    assert_eq!(read_blocks, load.host_blocks);
    assert!(plan.disk_reads.iter().all(|t| t.load_job == Some(load.job)));
    // Not before its disk reads ran.
    assert!(m.complete_transfers(&[load.job], &[]).is_err());
    assert!(model.run(&mut m, &plan).is_empty());
    // The loaded blocks hold r0's blocks 5..9, as written to disk.
    for (i, b) in load.device_blocks.iter().enumerate() {
        assert_eq!(model.device[b], (1, 5 + i));
    }
    let s = m.offload_stats().unwrap();
    assert_eq!(
        (s.disk_hits, s.disk_reads_completed, s.loads_completed),
        (5, 5, 1)
    );
    // Published: r3 (r0's prompt) hits 36 tokens on the device.
    add(&mut m, "r3", prompt(1, 40));
    assert_eq!(m.get_computed_blocks("r3").unwrap().num_computed_tokens, 36);
    m.check_invariants().unwrap();
    drop(m);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_corrupt_disk_chunk_fails_its_load() {
    let d = dir("corrupt");
    let (mut m, mut model) = on_disk_only(&d);
    let path = m.offload_disk().unwrap().path().unwrap().to_owned();
    std::fs::write(&path, vec![0xAB; 64]).unwrap(); // truncated and overwritten
    add(&mut m, "r2", prompt(1, 44));
    assert_eq!(admit(&mut m, "r2").1, 20);
    let plan = m.take_transfer_plan().unwrap();
    let load = plan.loads[0].job;
    // Every read fails; the load copied nothing and completes failed.
    assert_eq!(model.run(&mut m, &plan).len(), 5);
    // (run reported the load done: the manager fails it all the same)
    let s = m.offload_stats().unwrap();
    assert_eq!((s.disk_reads_failed, s.loads_failed), (5, 1));
    assert_eq!(m.offload_disk().unwrap().counters().corrupt, 5);
    assert!(m.complete_transfers(&[load], &[]).is_err());
    // Nothing was published: r3 hits the device head only.
    add(&mut m, "r3", prompt(1, 40));
    let hit = m.get_computed_blocks("r3").unwrap();
    assert_eq!((hit.num_computed_tokens, hit.num_host_tokens), (20, 0));
    m.check_invariants().unwrap();
    drop(m);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn disk_calls_refuse_bad_jobs_and_buffers() {
    let d = dir("bad");
    let (mut m, _) = on_disk_only(&d);
    add(&mut m, "r2", prompt(1, 44));
    admit(&mut m, "r2");
    let plan = m.take_transfer_plan().unwrap();
    let (read, load) = (plan.disk_reads[0].job, plan.loads[0].job);
    let mut small = [0u8; CHUNK - 1];
    assert!(m.read_disk_chunk(read, &mut small).is_err());
    assert!(m.read_disk_chunk(load, &mut [0u8; CHUNK]).is_err());
    assert!(m.write_disk_chunk(read, &[0u8; CHUNK]).is_err());
    assert!(m.read_disk_chunk(9999, &mut [0u8; CHUNK]).is_err());
    assert!(m.complete_transfers(&[read], &[]).is_err());
    // 5 reads, the load, and the store of r2's device hit (r0's head, gone
    // from host memory).
    assert_eq!(m.num_transfers_in_flight(), 7);
    assert_eq!(plan.stores.len(), 1);
    assert!(!m.reset_offload());
    // Abandoning the reads fails the load.
    let reads: Vec<u64> = plan.disk_reads.iter().map(|t| t.job).collect();
    m.complete_transfers(&[], &reads).unwrap();
    let failed = m
        .complete_transfers(&[load, plan.stores[0].job], &[])
        .unwrap();
    assert_eq!(failed[0].num_valid_tokens, 20);
    assert_eq!(m.num_transfers_in_flight(), 0);
    m.check_invariants().unwrap();
    // A disk tier promotes through host memory: every offer admitted.
    let mut other = KvCacheManager::new(ManagerConfig::full_attention(16, 4, 256)).unwrap();
    let cfg = OffloadConfig {
        store_threshold: 2,
        disk: Some(DiskConfig {
            dir: Some(d.clone()),
            capacity_bytes: 1 << 20,
            chunk_bytes: 8,
            enable_events: false,
        }),
        ..OffloadConfig::new(8)
    };
    assert!(matches!(
        other.enable_offload(cfg),
        Err(Error::InvalidConfig(_))
    ));
    let not_a_dir = OffloadConfig {
        disk: Some(DiskConfig {
            dir: Some(d.join("missing")),
            capacity_bytes: 1 << 20,
            chunk_bytes: 8,
            enable_events: false,
        }),
        ..OffloadConfig::new(8)
    };
    assert!(matches!(
        other.enable_offload(not_a_dir),
        Err(Error::InvalidConfig(_))
    ));
    assert!(other.offload_config().is_none());
    drop(m);
    std::fs::remove_dir_all(&d).unwrap();
}
