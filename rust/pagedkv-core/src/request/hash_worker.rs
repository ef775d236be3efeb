//! The prompt-hash worker (`background_hashing`): a thread hashing prompts in
//! submission order, each prompt's hashes pending until first read; the
//! prompt is lent to the job, not copied, and read through it until the
//! request's first mutation takes it back (`Request::hash_in_background`,
//! `Request::settle`).

use super::Request;
use crate::hash::{BlockHash, BlockHasher};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

impl Request {
    /// Hands the prompt to `worker` to hash; the request's hashes are pending
    /// until a mutation settles them.
    pub fn hash_in_background(
        &mut self,
        worker: &HashWorker,
        hasher: &BlockHasher,
        hash_block_size: usize,
    ) {
        debug_assert!(self.pending.is_none() && self.hash_vec.is_empty());
        // The job gets a copy of the request without its blocks and with the
        // prompt itself, lent (not copied) until the request settles.
        let tokens = std::mem::take(&mut self.tokens);
        let groups = std::mem::take(&mut self.group_vec);
        let mut input = Box::new(self.clone());
        self.group_vec = groups;
        self.lent = tokens.len();
        input.tokens = tokens;
        let job = Arc::new(HashJob::new(input, hasher.same_kind(), hash_block_size));
        worker.submit(&job);
        self.pending = Some(job);
    }

    /// Takes the background hashes and the lent prompt back into the request
    /// (the hashes computed here, with `hasher`, if the worker could not).
    pub(super) fn settle(&mut self, hasher: Option<&mut BlockHasher>, hash_block_size: usize) {
        let Some(job) = self.pending.take() else {
            return;
        };
        job.wait_output();
        let done = match Arc::try_unwrap(job) {
            Ok(job) => job.result.into_inner(),
            Err(job) => job.result.get().cloned(),
        };
        // Set: it was waited for above, and a set result stays set.
        let Some(out) = done else {
            return;
        };
        if self.lent > 0 {
            // Nothing was appended while the prompt was lent (every mutation
            // settles first), so the prompt comes back whole.
            debug_assert!(self.tokens.is_empty());
            self.tokens = out.tokens;
            self.lent = 0;
        }
        if let Some(chain) = out.chain {
            self.hash_vec = chain.hashes;
            self.ctx_vec = chain.ctx;
        } else {
            self.hash_vec.clear();
            self.ctx_vec.clear();
            if let Some(hasher) = hasher {
                self.update_hashes(hasher, hash_block_size);
            }
        }
    }
}

/// A prompt's block hashes and, with verification, its context digests.
#[derive(Clone, Debug, Default)]
pub(crate) struct HashChain {
    pub(super) hashes: Vec<BlockHash>,
    pub(super) ctx: Vec<[u8; 32]>,
}

/// A prompt's hashes, computed by whoever gets to them first: the manager's
/// worker thread, or the first caller that needs them before the worker has
/// started on them (so a lookup never waits behind the queue: at worst it
/// hashes its own prompt, as without the worker). `None` if the hashing failed
/// (the request then hashes in place when it settles).
#[derive(Debug)]
pub(crate) struct HashJob {
    /// The request to hash (a copy without blocks, holding the lent prompt),
    /// its hasher and the hash block size, until someone takes them.
    input: Mutex<Option<(Box<Request>, BlockHasher, usize)>>,
    result: OnceLock<JobOutput>,
}

/// What a hash job hands back: the lent tokens, and the hashes (`None` if the
/// hashing failed; the request then hashes in place when it settles).
#[derive(Clone, Debug)]
pub(super) struct JobOutput {
    pub(super) tokens: Vec<u32>,
    chain: Option<HashChain>,
}

/// An empty chain, what a request reads while a failed job awaits settling.
static NO_HASHES: HashChain = HashChain {
    hashes: Vec::new(),
    ctx: Vec::new(),
};

impl HashJob {
    pub(super) fn new(req: Box<Request>, hasher: BlockHasher, hash_block_size: usize) -> Self {
        Self {
            input: Mutex::new(Some((req, hasher, hash_block_size))),
            result: OnceLock::new(),
        }
    }

    /// Hashes the prompt if nobody has taken it yet.
    fn run(&self) {
        let taken = match self.input.lock() {
            Ok(mut input) => input.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        let Some((mut req, mut hasher, hbs)) = taken else {
            return;
        };
        // A panic here must not leave a reader waiting forever, nor lose the
        // lent tokens.
        let chain = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            req.update_hashes(&mut hasher, hbs);
            HashChain {
                hashes: std::mem::take(&mut req.hash_vec),
                ctx: std::mem::take(&mut req.ctx_vec),
            }
        }));
        let tokens = std::mem::take(&mut req.tokens);
        let _ = self.result.set(JobOutput {
            tokens,
            chain: chain.ok(),
        });
    }

    /// The job's output, once someone has run it (here, if nobody has taken it
    /// yet).
    pub(super) fn wait_output(&self) -> &JobOutput {
        if let Some(done) = self.result.get() {
            return done;
        }
        self.run();
        self.result.wait()
    }

    pub(super) fn wait(&self) -> &HashChain {
        self.wait_output().chain.as_ref().unwrap_or(&NO_HASHES)
    }
}

/// The manager's prompt-hashing thread: runs each submitted job nobody has
/// taken yet, in submission order. Dropping it ends the thread once the queue is
/// drained.
#[derive(Debug)]
pub(crate) struct HashWorker {
    tx: Option<mpsc::Sender<Arc<HashJob>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The fork generation it was spawned in ([`crate::fork`]).
    generation: u64,
}

impl HashWorker {
    pub fn spawn() -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Arc<HashJob>>();
        let thread = std::thread::Builder::new()
            .name("pagedkv-hash".into())
            .spawn(move || {
                while let Some(job) = next_job(&rx) {
                    crate::fork::enter_job();
                    job.run();
                    crate::fork::leave_job();
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            generation: crate::fork::generation(),
        })
    }

    /// Whether the process forked since the worker was spawned and this is the
    /// child: the thread stayed in the parent.
    pub fn left_behind(&self) -> bool {
        self.generation != crate::fork::generation()
    }

    /// Queues the job; if the thread is gone, its first reader runs it.
    fn submit(&self, job: &Arc<HashJob>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Arc::clone(job));
        }
    }
}

/// How the hash worker waits for the next prompt: it naps [`WORKER_NAP`] at a
/// time until it has been idle for [`WORKER_IDLE`], and only then sleeps on the
/// queue. While it naps a prompt submitted costs its sender no wake-up (a futex
/// call on the scheduler's critical path; its cost: docs/perf-log.md); an idle manager's worker stops waking up after [`WORKER_IDLE`]. It
/// does not spin between naps: polling burnt a core and slowed the scheduler's
/// thread beside it without shortening any step (a prompt the worker has not
/// started when a lookup needs it is hashed by the lookup).
const WORKER_NAP: std::time::Duration = std::time::Duration::from_micros(50);
const WORKER_IDLE: std::time::Duration = std::time::Duration::from_millis(20);

/// The next job (see [`WORKER_NAP`]); None once every sender is gone.
fn next_job<T>(rx: &mpsc::Receiver<T>) -> Option<T> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(item) => return Some(item),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if start.elapsed() < WORKER_IDLE {
            std::thread::sleep(WORKER_NAP);
        } else {
            return rx.recv().ok();
        }
    }
}

impl Drop for HashWorker {
    fn drop(&mut self) {
        if self.left_behind() {
            // In a forked child: there is no thread to join, and the channel
            // may have been in use by the parent's thread at the fork.
            std::mem::forget(self.tx.take());
            std::mem::forget(self.thread.take());
            return;
        }
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
