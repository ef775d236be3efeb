//! The disk tier under the host tier ([`OffloadConfig::disk`](super::OffloadConfig)):
//! write-through from host memory, reads promoted through it.
//!
//! - A chunk stored in host memory is written to disk: once its store
//!   completes it is pinned in host memory (not a request's access) and a
//!   disk write is planned; [`KvCacheManager::write_disk_chunk`] writes the
//!   bytes the engine gathered from its host slot and unpins it.
//! - A host hit continues on disk: a chunk absent from host memory and on disk
//!   counts. Admitting it reserves a host slot for it (`prepare_store`, as a
//!   store of the request's), plans a disk read into that slot and the load
//!   from it; [`KvCacheManager::read_disk_chunk`] reads the file (its checksum
//!   checked) into the engine's buffer, then the chunk is readable and pinned
//!   for the load. A read that fails (corrupt, truncated, gone) frees the slot
//!   and fails the load: its tokens are recomputed, never served.

use rustc_hash::FxHashMap;

use super::{DiskTransfer, Offloading};
use crate::error::{Error, Result, invalid};
use crate::manager::KvCacheManager;
use crate::offload::{DiskRead, DiskTier, OffloadKey};

#[derive(Clone, Copy, Debug)]
struct DiskJob {
    key: OffloadKey,
    /// The chunk's host slot.
    slot: u64,
    /// A read's load job; `None` for a write.
    load_job: Option<u64>,
    taken: bool,
}

/// The disk tier and its copies in flight.
#[derive(Debug)]
pub(super) struct DiskSide {
    pub(super) tier: DiskTier,
    jobs: FxHashMap<u64, DiskJob>,
    /// Jobs not handed out yet, in order.
    planned: Vec<u64>,
}

impl DiskSide {
    pub(super) fn new(tier: DiskTier) -> Self {
        Self {
            tier,
            jobs: FxHashMap::default(),
            planned: Vec::new(),
        }
    }

    pub(super) fn num_jobs(&self) -> usize {
        self.jobs.len()
    }
}

impl Offloading {
    /// Whether `key` can be read from disk (and is not in host memory).
    pub(super) fn on_disk(&self, key: &OffloadKey) -> bool {
        self.disk
            .as_ref()
            .is_some_and(|d| d.tier.contains(key) && self.tier.chunk(key).is_none())
    }

    fn new_disk_job(&mut self, key: OffloadKey, slot: u64, load_job: Option<u64>) -> u64 {
        let job = self.next_job;
        self.next_job += 1;
        let disk = self.disk.as_mut().expect("a disk tier");
        disk.jobs.insert(
            job,
            DiskJob {
                key,
                slot,
                load_job,
                taken: false,
            },
        );
        disk.planned.push(job);
        job
    }

    /// Admission of a host hit with chunks on disk (`keys[i]` for `i` in
    /// `from_disk`): host slots reserved for them. `None`: host memory has no
    /// room (every chunk pinned); nothing reserved.
    pub(super) fn reserve_promotions(
        &mut self,
        keys: &[OffloadKey],
        positions: &[i64],
        uid: u64,
    ) -> Result<Option<Vec<u64>>> {
        let Some(stored) = self.tier.prepare_store(keys, uid, positions)? else {
            return Ok(None);
        };
        self.stats.evictions += stored.evicted.len() as u64;
        if stored.keys_to_store != keys {
            // Absent keys with every offer admitted (store_threshold 1) are
            // all stored; anything else is a broken tier.
            self.tier.complete_store(&stored.keys_to_store, false);
            return Err(Error::InvariantViolation(
                "the host tier did not take every chunk promoted from disk".into(),
            ));
        }
        Ok(Some(stored.slots))
    }

    /// The disk reads of an admitted load job (`keys` promoted into `slots`).
    pub(super) fn plan_disk_reads(&mut self, load_job: u64, keys: &[OffloadKey], slots: &[u64]) {
        for (k, &s) in keys.iter().zip(slots) {
            self.new_disk_job(*k, s, Some(load_job));
        }
        self.stats.disk_hits += keys.len() as u64;
    }

    /// Chunks whose store to host memory completed: written through to disk
    /// (pinned in host memory until written).
    pub(super) fn queue_disk_writes(&mut self, keys: &[OffloadKey]) -> Result<()> {
        if self.disk.is_none() {
            return Ok(());
        }
        for k in keys {
            let on_disk = self.disk.as_ref().is_some_and(|d| d.tier.contains(k));
            if on_disk || !self.tier.chunk(k).is_some_and(|c| c.is_ready()) {
                continue;
            }
            let slot = self.tier.prepare_read(std::slice::from_ref(k))?[0];
            self.new_disk_job(*k, slot, None);
        }
        Ok(())
    }

    /// The planned disk copies, handed out: reads, then writes.
    pub(super) fn take_disk_plan(
        &mut self,
        reads: &mut Vec<DiskTransfer>,
        writes: &mut Vec<DiskTransfer>,
    ) {
        let bpc = u64::from(self.cfg.blocks_per_chunk);
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        for job in std::mem::take(&mut disk.planned) {
            let j = disk.jobs.get_mut(&job).expect("a planned disk job");
            j.taken = true;
            let t = DiskTransfer {
                job,
                group: j.key.group_idx(),
                host_blocks: (0..bpc).map(|b| j.slot * bpc + b).collect(),
                load_job: j.load_job,
            };
            if j.load_job.is_some() {
                reads.push(t);
            } else {
                writes.push(t);
            }
        }
    }

    /// Whether `job` is a disk job handed out.
    pub(super) fn disk_job_taken(&self, job: u64) -> bool {
        self.disk
            .as_ref()
            .and_then(|d| d.jobs.get(&job))
            .is_some_and(|j| j.taken)
    }

    /// The disk reads of `load_job` among `jobs`.
    pub(super) fn reads_of(&self, load_job: u64, jobs: &[u64]) -> u32 {
        let Some(d) = &self.disk else { return 0 };
        jobs.iter()
            .filter(|j| d.jobs.get(j).is_some_and(|j| j.load_job == Some(load_job)))
            .count() as u32
    }

    /// Ends a disk job: a read `ok` makes its chunk readable and pins it for
    /// its load; a failed read frees the slot and fails the load; a write
    /// unpins its chunk.
    fn finish_disk_job(&mut self, job: u64, ok: bool) -> Result<()> {
        let j = self
            .disk
            .as_mut()
            .and_then(|d| d.jobs.remove(&job))
            .expect("checked by the caller");
        let key = std::slice::from_ref(&j.key);
        match j.load_job {
            None => {
                self.tier.complete_load(key)?;
                if ok {
                    self.stats.disk_writes_completed += 1;
                } else {
                    self.stats.disk_writes_failed += 1;
                }
            }
            Some(load) => {
                self.tier.complete_store(key, ok);
                let load = self.jobs.get_mut(&load);
                if ok {
                    self.stats.disk_reads_completed += 1;
                } else {
                    self.stats.disk_reads_failed += 1;
                }
                if let Some(l) = load {
                    l.disk_reads -= 1;
                    if ok {
                        self.tier.prepare_read(key)?;
                        l.keys.push(j.key);
                    } else {
                        l.poisoned = true;
                    }
                }
            }
        }
        Ok(())
    }

    /// Abandons a disk job the engine reports failed.
    pub(super) fn abandon_disk_job(&mut self, job: u64) -> Result<()> {
        self.finish_disk_job(job, false)
    }

    /// Cancels the disk reads of a load cancelled before it was handed out.
    pub(super) fn cancel_disk_reads(&mut self, load_job: u64) {
        let Some(d) = self.disk.as_mut() else { return };
        let gone: Vec<u64> = d
            .planned
            .iter()
            .copied()
            .filter(|j| d.jobs[j].load_job == Some(load_job))
            .collect();
        d.planned.retain(|j| !gone.contains(j));
        for job in gone {
            let j = d.jobs.remove(&job).expect("a planned disk job");
            self.tier
                .complete_store(std::slice::from_ref(&j.key), false);
        }
    }

    /// Every disk job's chunk in the state its copy needs.
    pub(super) fn check_disk(&self) -> Result<()> {
        let Some(d) = &self.disk else { return Ok(()) };
        d.tier.check_invariants()?;
        for (job, j) in &d.jobs {
            let c = self.tier.chunk(&j.key);
            let fine = match j.load_job {
                None => c.is_some_and(|c| c.is_ready() && c.ref_cnt > 0),
                Some(_) => c.is_some_and(|c| !c.is_ready()),
            };
            if !fine || c.is_some_and(|c| c.slot != j.slot) {
                return Err(Error::InvariantViolation(format!(
                    "disk job {job}: its chunk {:?} is not in the state the copy needs",
                    j.key
                )));
            }
        }
        Ok(())
    }
}

impl KvCacheManager {
    fn disk_job(&self, job: u64, read: bool) -> Result<DiskJob> {
        let off = self
            .offload
            .as_deref()
            .ok_or_else(|| invalid("the manager has no host tier"))?;
        let j = off
            .disk
            .as_ref()
            .ok_or_else(|| invalid("the host tier has no disk tier"))?
            .jobs
            .get(&job)
            .filter(|j| j.taken && j.load_job.is_some() == read)
            .copied();
        j.ok_or_else(|| {
            invalid(format!(
                "disk {} job {job} is not in flight",
                if read { "read" } else { "write" }
            ))
        })
    }

    /// Runs a planned disk read: the chunk's bytes into `out` (one chunk of
    /// its group), checked against their checksum. `true`: the chunk is in
    /// host memory once the engine copied `out` into the read's host blocks,
    /// and its load may run; `false`: the read failed (counted, the bytes
    /// zeroed), its load fails and its tokens are recomputed.
    ///
    /// # Errors
    /// A job that is not a disk read in flight, or `out` not one chunk's
    /// size: nothing changes.
    ///
    /// # Panics
    /// Never: the job is checked first.
    pub fn read_disk_chunk(&mut self, job: u64, out: &mut [u8]) -> Result<bool> {
        let j = self.disk_job(job, true)?;
        let off = self.offload.as_deref_mut().expect("checked above");
        let disk = off.disk.as_mut().expect("checked above");
        let ok = disk.tier.get(&j.key, out)? == DiskRead::Hit;
        off.finish_disk_job(job, ok)?;
        Ok(ok)
    }

    /// Runs a planned disk write: `data` (the chunk's bytes, gathered from
    /// its host blocks) to the disk tier, which evicts for room. `false`: the
    /// disk refused the write (full; counted). The chunk is unpinned in host
    /// memory either way.
    ///
    /// # Errors
    /// A job that is not a disk write in flight, or `data` not one chunk's
    /// size: nothing changes.
    ///
    /// # Panics
    /// Never: the job is checked first.
    pub fn write_disk_chunk(&mut self, job: u64, data: &[u8]) -> Result<bool> {
        let j = self.disk_job(job, false)?;
        let off = self.offload.as_deref_mut().expect("checked above");
        let disk = off.disk.as_mut().expect("checked above");
        let ok = disk.tier.put(&j.key, data)?;
        off.finish_disk_job(job, ok)?;
        Ok(ok)
    }

    /// The disk tier (read-only), for its readouts.
    #[must_use]
    pub fn offload_disk(&self) -> Option<&DiskTier> {
        self.offload
            .as_ref()
            .and_then(|o| o.disk.as_ref())
            .map(|d| &d.tier)
    }
}
