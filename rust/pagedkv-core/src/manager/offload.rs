//! The manager with a host tier below GPU memory ([`OffloadTier`]): a lookup
//! reports the chunks of a request's prefix the tier holds past the device
//! hit, admitting the request reserves device blocks for them and schedules
//! their load, and every full chunk a request computes is offered to the tier
//! (vLLM 0.33's `OffloadingConnector` scheduler with its CPU tier, for an
//! engine that drives pagedkv itself).
//!
//! Each step the engine takes a [`TransferPlan`]: loads (host blocks into
//! device blocks, run before the step's forward pass) and stores (device
//! blocks into host blocks, run after it), then reports every job done or
//! failed with [`KvCacheManager::complete_transfers`]. Until a load completes
//! its device blocks are not published to the prefix cache; a failed load is
//! never published and its request recomputes those tokens. The device blocks
//! a job reads or writes hold one engine reference for the job's life, so a
//! request freed or preempted mid-transfer never has them handed out again
//! while the copy runs; a load not yet taken is cancelled with the request.
//!
//! A chunk is `blocks_per_chunk` blocks of one group, keyed as vLLM keys it:
//! the block hash of its last hash block and the group index.

mod disk;
mod readouts;
mod types;
mod write_back;

use rustc_hash::FxHashMap;

use disk::DiskSide;
pub use types::{
    DiskTransfer, FailedLoad, OffloadConfig, OffloadStats, Transfer, TransferPlan, WritePolicy,
};
use write_back::{WRITE_BACK_UIDS, WriteBack};

use super::{AllocateArgs, ComputedBlocks, KvCacheManager};
use crate::error::{Error, Result, invalid};
use crate::offload::{LookupResult, OffloadKey, OffloadTier, TierConfig};
use crate::pool::BlockId;
use crate::spec::AttentionKind;

/// One request's offloading state.
#[derive(Clone, Debug, Default)]
struct ReqOffload {
    /// The first chunk not offered to the tier yet.
    next_chunk: usize,
    /// Its load job in flight (planned or taken), at most one.
    load_job: Option<u64>,
}

#[derive(Clone, Debug)]
struct Job {
    /// The request's slot and uid when the job was made.
    slot: u32,
    uid: u64,
    keys: Vec<OffloadKey>,
    /// Per group touched: the device blocks (one engine reference each) and
    /// host blocks.
    groups: Vec<(u32, Vec<BlockId>, Vec<u64>)>,
    /// A load's device hit (the tokens valid if it fails) and the tokens it
    /// makes computed.
    load: Option<(u64, u64)>,
    taken: bool,
    /// A load's disk reads not run yet (its chunks promoted from disk).
    disk_reads: u32,
    /// A load one of whose disk reads failed: it fails too.
    poisoned: bool,
}

/// An admitted host hit's chunks, for its load job.
struct LoadChunks {
    /// The hit's first chunk.
    start: usize,
    /// Device hit, host hit and the end of the last chunk, in tokens.
    tokens: (u64, u64, u64),
    /// Every chunk key's host slot (chunk by chunk, group by group).
    slots: Vec<u64>,
    /// The keys read from host memory (pinned for the load).
    host_keys: Vec<OffloadKey>,
    /// The keys read from disk first, and the host slots they go to.
    disk_keys: Vec<OffloadKey>,
    disk_slots: Vec<u64>,
}

/// The host tier and the jobs in flight (a [`KvCacheManager`] field).
#[derive(Debug)]
pub(crate) struct Offloading {
    cfg: OffloadConfig,
    tier: OffloadTier,
    /// Tokens per block (every group's).
    block_size: u64,
    /// Hash blocks per block.
    hashes_per_block: usize,
    num_groups: usize,
    reqs: FxHashMap<u64, ReqOffload>,
    jobs: FxHashMap<u64, Job>,
    /// Load jobs not taken yet, in order.
    planned_loads: Vec<u64>,
    next_job: u64,
    stats: OffloadStats,
    /// Freed chunks waiting to be written back (write-back only).
    write_back: Option<WriteBack>,
    /// The disk tier below, with its copies in flight.
    disk: Option<DiskSide>,
}

impl Offloading {
    fn tokens_per_chunk(&self) -> u64 {
        self.block_size * u64::from(self.cfg.blocks_per_chunk)
    }

    fn hashes_per_chunk(&self) -> usize {
        self.hashes_per_block * self.cfg.blocks_per_chunk as usize
    }

    fn state(&mut self, uid: u64) -> &mut ReqOffload {
        let tier = &mut self.tier;
        self.reqs.entry(uid).or_insert_with(|| {
            tier.on_new_request(uid);
            ReqOffload::default()
        })
    }

    /// A store job of `keys` (the tier's slots reserved) copying `groups`'
    /// device blocks into their host blocks: its transfers to `out`, its
    /// device blocks to be held while it runs.
    fn add_store_job(
        &mut self,
        (slot, uid, request_id): (u32, u64, &str),
        keys: Vec<OffloadKey>,
        groups: Vec<(u32, Vec<BlockId>, Vec<u64>)>,
        (out, to_touch): (&mut Vec<Transfer>, &mut Vec<BlockId>),
    ) {
        let job = self.next_job;
        self.next_job += 1;
        for (g, d, h) in &groups {
            out.push(Transfer {
                job,
                request_id: request_id.to_owned(),
                group: *g,
                device_blocks: d.clone(),
                host_blocks: h.clone(),
            });
            to_touch.extend_from_slice(d);
        }
        self.jobs.insert(
            job,
            Job {
                slot,
                uid,
                keys,
                groups,
                load: None,
                taken: true,
                disk_reads: 0,
                poisoned: false,
            },
        );
        self.stats.stores += 1;
    }

    /// The keys of chunk `c` in every group (`hashes` covers it).
    fn chunk_keys(&self, hashes: &[crate::hash::BlockHash], c: usize, out: &mut Vec<OffloadKey>) {
        let h = &hashes[(c + 1) * self.hashes_per_chunk() - 1];
        for g in 0..self.num_groups {
            // The hash is at most 32 bytes: within the key's bound.
            out.push(OffloadKey::new(h.as_bytes(), g as u32).expect("a block hash fits a key"));
        }
    }
}

impl KvCacheManager {
    /// Gives the manager a host tier (on a manager without requests yet).
    ///
    /// # Errors
    /// `InvalidConfig`: requests already added, a tier already set, caching
    /// off, a group that is not full attention (or MLA), groups of different
    /// block sizes, no chunk slot, or a tier the offload tier refuses.
    pub fn enable_offload(&mut self, cfg: OffloadConfig) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.offload.is_some() {
            return bad("the manager already has a host tier".into());
        }
        if self.num_requests() > 0 {
            return bad("a host tier is set before any request is added".into());
        }
        if !self.cfg.enable_caching {
            return bad("a host tier needs prefix caching (enable_caching)".into());
        }
        if cfg.num_chunks == 0 {
            return bad(
                "the host tier is smaller than one chunk (num_chunks must be at least 1)".into(),
            );
        }
        if cfg.blocks_per_chunk == 0 {
            return bad("blocks_per_chunk must be at least 1".into());
        }
        if let WritePolicy::WriteBack { window } = cfg.write_policy
            && window < cfg.blocks_per_chunk
        {
            return bad(format!(
                "the write-back window ({window} blocks) is smaller than a chunk ({} blocks)",
                cfg.blocks_per_chunk
            ));
        }
        let groups = &self.cfg.groups;
        for (g, spec) in groups.iter().enumerate() {
            if !matches!(
                spec.kind,
                AttentionKind::FullAttention | AttentionKind::MlaAttention
            ) {
                return bad(format!(
                    "a host tier keeps full-attention groups only; group {g} is {:?}",
                    spec.kind
                ));
            }
            if spec.block_size != groups[0].block_size {
                return bad(format!(
                    "a host tier needs one block size; group {g} has {} tokens per block, \
                     group 0 {}",
                    spec.block_size, groups[0].block_size
                ));
            }
        }
        if cfg.disk.is_some() && cfg.store_threshold > 1 {
            return bad(
                "a disk tier promotes chunks through host memory: store_threshold must be 1".into(),
            );
        }
        let disk = cfg
            .disk
            .clone()
            .map(|d| {
                crate::offload::DiskTier::open(crate::offload::DiskConfig {
                    enable_events: cfg.enable_events,
                    ..d
                })
            })
            .transpose()?
            .map(DiskSide::new);
        let block_size = u64::from(groups[0].block_size);
        let tier = OffloadTier::new(TierConfig {
            num_chunks: cfg.num_chunks,
            policy: cfg.policy,
            enable_events: cfg.enable_events,
            store_threshold: cfg.store_threshold,
            ..TierConfig::new(cfg.num_chunks)
        })
        .map_err(|e| Error::InvalidConfig(e.to_string()))?;
        self.offload = Some(Box::new(Offloading {
            tier,
            block_size,
            hashes_per_block: groups[0].block_size as usize / self.hash_block_size,
            num_groups: groups.len(),
            reqs: FxHashMap::default(),
            jobs: FxHashMap::default(),
            planned_loads: Vec::new(),
            next_job: 1,
            stats: OffloadStats::default(),
            write_back: match cfg.write_policy {
                WritePolicy::WriteThrough => None,
                WritePolicy::WriteBack { window } => Some(WriteBack::new(window)),
            },
            disk,
            cfg,
        }));
        Ok(())
    }

    /// The host tier's configuration (`None` without one).
    #[must_use]
    pub fn offload_config(&self) -> Option<&OffloadConfig> {
        self.offload.as_ref().map(|o| &o.cfg)
    }

    /// The host tier itself (read-only), for its readouts.
    #[must_use]
    pub fn offload_tier(&self) -> Option<&OffloadTier> {
        self.offload.as_ref().map(|o| &o.tier)
    }

    /// The host hit past a device hit of `device` tokens: the tokens of the
    /// chunks every group holds readable, from the chunk the device hit ends
    /// in on, at least one chunk, at most `num_tokens - 1` (vLLM looks up to
    /// the prompt's end; the last token is recomputed). 0 while the request
    /// has a load in flight.
    pub(super) fn host_hit(&mut self, slot: u32, device: u64, cap: Option<u64>) -> u64 {
        let Some(off) = self.offload.as_deref_mut() else {
            return 0;
        };
        let req = self.table.get(slot);
        let uid = req.uid;
        if off.state(uid).load_job.is_some() {
            return 0;
        }
        let num_tokens = req.num_tokens() as u64;
        let tpc = off.tokens_per_chunk();
        let hashes = req.hashes();
        let mut end_cap = num_tokens;
        if let Some(c) = cap {
            end_cap = end_cap.min(c);
        }
        let num_chunks = (end_cap / tpc).min((hashes.len() / off.hashes_per_chunk()) as u64);
        let start = device / tpc;
        if start >= num_chunks {
            return 0;
        }
        off.stats.queries += 1;
        let mut keys = Vec::with_capacity(off.num_groups);
        let mut hits = 0;
        for c in start..num_chunks {
            keys.clear();
            off.chunk_keys(hashes, c as usize, &mut keys);
            let readable = keys.iter().all(|k| match off.tier.lookup(k) {
                LookupResult::Hit => true,
                LookupResult::Miss => off.on_disk(k),
                LookupResult::HitPending => false,
            });
            if !readable {
                break;
            }
            hits += 1;
        }
        let end = (start + hits) * tpc;
        if end < device + tpc {
            return 0;
        }
        let host = end.min(num_tokens - 1) - device;
        off.stats.hits += 1;
        off.stats.hit_tokens += host;
        host
    }

    /// `allocate_slots` for an admission that takes a host hit: the device
    /// hit adopted whole, `num_external_computed_tokens` the host hit; the
    /// host chunks must still be readable. Caching waits for the load.
    pub(super) fn allocate_with_host_hit(
        &mut self,
        slot: u32,
        a: &AllocateArgs,
        hit: &ComputedBlocks,
    ) -> Result<bool> {
        let host = hit.num_host_tokens;
        let device = hit.num_computed_tokens;
        if a.num_computed_tokens != 0 || a.num_new_computed_tokens != device {
            return Err(invalid(format!(
                "a host hit is taken at admission with the whole device hit: \
                 num_computed_tokens 0 and num_new_computed_tokens {device}"
            )));
        }
        let off = self
            .offload
            .as_deref()
            .ok_or_else(|| invalid("no host tier"))?;
        let tpc = off.tokens_per_chunk();
        let end = (device + host).div_ceil(tpc) * tpc;
        if device + host + a.num_new_tokens < end {
            return Err(invalid(format!(
                "the host hit loads through token {end}: schedule at least {} new tokens",
                end - device - host
            )));
        }
        let (start, end_chunk) = ((device / tpc) as usize, (end / tpc) as usize);
        let req = self.table.get(slot);
        let uid = req.uid;
        if off.reqs.get(&uid).is_some_and(|r| r.load_job.is_some()) {
            return Err(invalid(format!(
                "request {:?} already has a load in flight",
                req.id
            )));
        }
        let (keys, from_disk) = self.hit_chunk_keys(slot, start..end_chunk)?;
        let positions: Vec<i64> = (start..end_chunk)
            .flat_map(|c| std::iter::repeat_n(c as i64, self.num_groups()))
            .collect();
        let pick = |disk: bool| -> (Vec<OffloadKey>, Vec<i64>) {
            keys.iter()
                .zip(&positions)
                .zip(&from_disk)
                .filter(|&(_, &d)| d == disk)
                .map(|((k, p), _)| (*k, *p))
                .unzip()
        };
        let ((disk_keys, disk_pos), (host_keys, host_pos)) = (pick(true), pick(false));
        let off = self.offload.as_deref_mut().expect("checked above");
        off.state(uid);
        // The host chunks are pinned while room is made for the promoted ones.
        let guarded: &[OffloadKey] = if disk_keys.is_empty() {
            &[]
        } else {
            &host_keys
        };
        off.tier.prepare_read(guarded)?;
        let disk_slots = if disk_keys.is_empty() {
            Vec::new()
        } else {
            match off.reserve_promotions(&disk_keys, &disk_pos, uid) {
                Ok(Some(s)) => s,
                other => {
                    off.tier.complete_load(guarded)?;
                    return other.map(|_| false);
                }
            }
        };
        let args = AllocateArgs {
            num_external_computed_tokens: host,
            delay_cache_blocks: true,
            ..*a
        };
        let admitted = self.allocate_validated(slot, &args, Some(hit));
        let off = self.offload.as_deref_mut().expect("checked above");
        if !matches!(admitted, Ok(true)) {
            off.tier.complete_store(&disk_keys, false);
            off.tier.complete_load(guarded)?;
            return admitted;
        }
        // The host chunks are readable (pinned above): the request's load.
        let host_slots = off.tier.prepare_load(&host_keys, uid, &host_pos)?;
        off.tier.complete_load(guarded)?;
        let (mut hs, mut ds) = (host_slots.iter(), disk_slots.iter());
        let slots: Vec<u64> = from_disk
            .iter()
            .map(|&d| *if d { ds.next() } else { hs.next() }.expect("one slot a key"))
            .collect();
        self.plan_load(
            slot,
            LoadChunks {
                start,
                tokens: (device, host, end),
                slots,
                host_keys,
                disk_keys,
                disk_slots,
            },
        )
    }

    /// The keys of a host hit's chunks (chunk by chunk, group by group) and
    /// whether each is read from disk; every one must still be readable in
    /// host memory or on disk.
    fn hit_chunk_keys(
        &self,
        slot: u32,
        chunks: std::ops::Range<usize>,
    ) -> Result<(Vec<OffloadKey>, Vec<bool>)> {
        let off = self.offload.as_deref().expect("checked by the caller");
        let req = self.table.get(slot);
        if chunks.end * off.hashes_per_chunk() > req.hashes().len() {
            return Err(Error::StaleComputedBlocks(
                "the host hit is past the request's hashed blocks; look it up again".into(),
            ));
        }
        let mut keys = Vec::with_capacity(chunks.len() * off.num_groups);
        for c in chunks {
            off.chunk_keys(req.hashes(), c, &mut keys);
        }
        let from_disk: Vec<bool> = keys.iter().map(|k| off.on_disk(k)).collect();
        if let Some((k, _)) = keys
            .iter()
            .zip(&from_disk)
            .find(|&(k, d)| !d && !off.tier.chunk(k).is_some_and(|c| c.is_ready()))
        {
            return Err(Error::StaleComputedBlocks(format!(
                "host chunk {k:?} of the hit was evicted since get_computed_blocks; \
                 look the request up again"
            )));
        }
        Ok((keys, from_disk))
    }

    /// The load job of an admitted host hit: every group's device blocks of
    /// the hit (held for the copy) and the host blocks they are read from.
    fn plan_load(&mut self, slot: u32, l: LoadChunks) -> Result<bool> {
        let (device, host, end) = l.tokens;
        let uid = self.table.get(slot).uid;
        let off = self.offload.as_deref().expect("checked by the caller");
        let bpc = u64::from(off.cfg.blocks_per_chunk);
        let (first_block, end_block) = (
            (device / off.block_size) as usize,
            (end / off.block_size) as usize,
        );
        let req = self.table.get(slot);
        let ng = self.num_groups();
        let mut groups = Vec::with_capacity(ng);
        for (g, gb) in req.groups().iter().enumerate() {
            let device_blocks = gb.blocks()[first_block..end_block].to_vec();
            let host_blocks = (first_block..end_block)
                .map(|b| {
                    let (c, i) = (b as u64 / bpc, b as u64 % bpc);
                    l.slots[(c as usize - l.start) * ng + g] * bpc + i
                })
                .collect();
            groups.push((g as u32, device_blocks, host_blocks));
        }
        for (_, blocks, _) in &groups {
            self.hold_blocks(blocks)?;
        }
        let off = self.offload.as_deref_mut().expect("checked above");
        let job = off.next_job;
        off.next_job += 1;
        off.jobs.insert(
            job,
            Job {
                slot,
                uid,
                keys: l.host_keys,
                groups,
                load: Some((device, device + host)),
                taken: false,
                disk_reads: l.disk_keys.len() as u32,
                poisoned: false,
            },
        );
        off.plan_disk_reads(job, &l.disk_keys, &l.disk_slots);
        off.planned_loads.push(job);
        off.state(uid).load_job = Some(job);
        off.stats.loads += 1;
        Ok(true)
    }

    /// The copies of this step: the loads admitted since the last plan, and a
    /// store for every full chunk a running request has cached and not offered
    /// to the tier yet (the tier decides which it keeps, evicting as its
    /// policy says).
    ///
    /// # Errors
    /// No host tier.
    pub fn take_transfer_plan(&mut self) -> Result<TransferPlan> {
        let off = self
            .offload
            .as_deref_mut()
            .ok_or_else(|| invalid("the manager has no host tier"))?;
        let mut plan = TransferPlan::default();
        off.take_disk_plan(&mut plan.disk_reads, &mut plan.disk_writes);
        for job in std::mem::take(&mut off.planned_loads) {
            let Some(j) = off.jobs.get_mut(&job) else {
                continue;
            };
            j.taken = true;
            let id = self.table.get(j.slot).id.clone();
            for (g, d, h) in &j.groups {
                plan.loads.push(Transfer {
                    job,
                    request_id: id.clone(),
                    group: *g,
                    device_blocks: d.clone(),
                    host_blocks: h.clone(),
                });
            }
        }
        if off.write_back.is_some() {
            self.plan_write_backs(&mut plan.stores)?;
        } else {
            self.plan_stores(&mut plan.stores)?;
        }
        Ok(plan)
    }

    fn plan_stores(&mut self, out: &mut Vec<Transfer>) -> Result<()> {
        let ng = self.num_groups();
        let mut keys = Vec::new();
        let mut to_touch = Vec::new();
        let off = self.offload.as_deref_mut().expect("checked by the caller");
        let bpc = off.cfg.blocks_per_chunk as usize;
        for (slot, req) in self.table.iter_slots() {
            let Some(cached) = req.groups().iter().map(|g| g.num_cached).min().flatten() else {
                continue;
            };
            let storable = (cached / bpc).min(req.hashes().len() / off.hashes_per_chunk());
            let uid = req.uid;
            let next = off.reqs.get(&uid).map_or(0, |r| r.next_chunk);
            if storable <= next {
                continue;
            }
            keys.clear();
            for c in next..storable {
                off.chunk_keys(req.hashes(), c, &mut keys);
            }
            let positions: Vec<i64> = (next..storable)
                .flat_map(|c| std::iter::repeat_n(c as i64, ng))
                .collect();
            off.state(uid).next_chunk = storable;
            let Some(stored) = off.tier.prepare_store(&keys, uid, &positions)? else {
                off.stats.stores_refused += 1;
                continue;
            };
            off.stats.evictions += stored.evicted.len() as u64;
            if stored.keys_to_store.is_empty() {
                continue;
            }
            let mut groups: Vec<(u32, Vec<BlockId>, Vec<u64>)> = (0..ng)
                .map(|g| (g as u32, Vec::new(), Vec::new()))
                .collect();
            // The keys to store are the offer's in offer order: one pass finds them.
            let mut i = 0;
            for (key, &s) in stored.keys_to_store.iter().zip(&stored.slots) {
                while keys[i] != *key {
                    i += 1;
                }
                let (c, g) = (next + i / ng, i % ng);
                let blocks = &req.groups()[g].blocks()[c * bpc..(c + 1) * bpc];
                groups[g].1.extend_from_slice(blocks);
                groups[g]
                    .2
                    .extend((0..bpc as u64).map(|b| s * bpc as u64 + b));
            }
            groups.retain(|(_, d, _)| !d.is_empty());
            off.add_store_job(
                (slot, uid, &req.id),
                stored.keys_to_store,
                groups,
                (out, &mut to_touch),
            );
        }
        self.hold_blocks(&to_touch)
    }

    /// Reports jobs of taken plans: `done` completed, `failed` did not. A
    /// completed load publishes its blocks to the prefix cache (when its
    /// request is still the one admitted); a failed one does not, and is
    /// listed for the engine to recompute those tokens. A store completes or
    /// fails in the tier. Every job releases its device blocks.
    ///
    /// # Errors
    /// A job not in flight, or listed twice; nothing changes then.
    ///
    /// # Panics
    /// Never: every job is checked before any changes.
    pub fn complete_transfers(&mut self, done: &[u64], failed: &[u64]) -> Result<Vec<FailedLoad>> {
        let off = self
            .offload
            .as_deref()
            .ok_or_else(|| invalid("the manager has no host tier"))?;
        let mut seen = rustc_hash::FxHashSet::default();
        for &job in done.iter().chain(failed) {
            let copy = off.jobs.get(&job).filter(|j| j.taken);
            if copy.is_none() && !off.disk_job_taken(job) {
                return Err(invalid(format!("transfer job {job} is not in flight")));
            }
            if !seen.insert(job) {
                return Err(invalid(format!("transfer job {job} is listed twice")));
            }
        }
        for &job in done {
            let Some(j) = off.jobs.get(&job) else {
                return Err(invalid(format!(
                    "disk job {job} completes through read_disk_chunk / write_disk_chunk \
                     (report it failed to abandon it)"
                )));
            };
            if j.disk_reads > off.reads_of(job, failed) {
                return Err(invalid(format!(
                    "load job {job} copies chunks whose disk reads have not run"
                )));
            }
        }
        let off = self.offload.as_deref_mut().expect("checked above");
        for &job in failed {
            if !off.jobs.contains_key(&job) {
                off.abandon_disk_job(job)?;
            }
        }
        let mut out = Vec::new();
        let both = done
            .iter()
            .map(|&j| (j, true))
            .chain(failed.iter().map(|&j| (j, false)));
        for (job, ok) in both {
            if !self
                .offload
                .as_deref()
                .is_some_and(|o| o.jobs.contains_key(&job))
            {
                continue; // a disk job, abandoned above
            }
            if let Some(f) = self.finish_job(job, ok)? {
                out.push(f);
            }
        }
        Ok(out)
    }

    fn finish_job(&mut self, job: u64, ok: bool) -> Result<Option<FailedLoad>> {
        let off = self.offload.as_deref_mut().expect("checked by the caller");
        let j = off.jobs.remove(&job).expect("checked by the caller");
        // A load one of whose disk reads failed holds no KV past the device hit.
        let ok = ok && !j.poisoned;
        let nblocks: u64 = j.groups.iter().map(|(_, d, _)| d.len() as u64).sum();
        let write_back = j.uid >= WRITE_BACK_UIDS;
        let live = self.table.live(j.slot).is_some_and(|r| r.uid == j.uid);
        let state = off.reqs.get_mut(&j.uid);
        let bytes = nblocks * off.cfg.bytes_per_block;
        let mut publish = None;
        let mut failed = None;
        if let Some((valid, to)) = j.load {
            let current = state.is_some_and(|s| {
                let mine = s.load_job == Some(job);
                if mine {
                    s.load_job = None;
                }
                mine
            });
            off.tier.complete_load(&j.keys)?;
            off.stats.record_completion(true, ok, nblocks, bytes);
            if !(live && current) {
                off.stats.completions_after_free += 1;
            } else if ok {
                publish = Some(to);
            } else {
                failed = Some(FailedLoad {
                    request_id: self.table.get(j.slot).id.clone(),
                    num_valid_tokens: valid,
                });
            }
        } else {
            off.tier.complete_store(&j.keys, ok);
            if ok {
                off.queue_disk_writes(&j.keys)?;
            }
            off.stats.record_completion(false, ok, nblocks, bytes);
            if !live && !write_back {
                off.stats.completions_after_free += 1;
            }
        }
        self.release_job_blocks(&j.groups)?;
        if let Some(to) = publish {
            let req = self.table.get_mut(j.slot);
            let at = req.num_computed_at_step;
            self.coord.cache_blocks(req, to as usize, at);
        }
        Ok(failed)
    }

    fn release_job_blocks(&mut self, groups: &[(u32, Vec<BlockId>, Vec<u64>)]) -> Result<()> {
        for (_, blocks, _) in groups {
            // Tail first, as a request frees its blocks.
            let rev: Vec<BlockId> = blocks.iter().rev().copied().collect();
            self.free_blocks(&rev)?;
        }
        Ok(())
    }

    /// A request releases its blocks (`finished`: it is removed too): a load
    /// not taken yet is cancelled, the chunks it offers restart from the first,
    /// and a finished request's accesses commit to the tier's policy.
    pub(super) fn offload_release(&mut self, slot: u32, finished: bool) -> Result<()> {
        self.write_back_record(slot);
        let uid = self.table.get(slot).uid;
        let Some(off) = self.offload.as_deref_mut() else {
            return Ok(());
        };
        let mut cancelled = None;
        if let Some(s) = off.reqs.get_mut(&uid) {
            s.next_chunk = 0;
            // A taken load's copy may be running: its blocks stay held until
            // it completes, and it no longer publishes anything.
            if let Some(job) = s
                .load_job
                .take()
                .filter(|j| off.jobs.get(j).is_some_and(|j| !j.taken))
            {
                off.planned_loads.retain(|&j| j != job);
                let j = off.jobs.remove(&job).expect("a planned load is a job");
                off.tier.complete_load(&j.keys)?;
                off.cancel_disk_reads(job);
                off.stats.loads_cancelled += 1;
                cancelled = Some(j.groups);
            }
        }
        if finished {
            off.tier.on_request_finished(uid, &[], &[])?;
            off.tier.forget_request(uid);
            off.reqs.remove(&uid);
        }
        if let Some(groups) = cancelled {
            self.release_job_blocks(&groups)?;
        }
        Ok(())
    }
}
