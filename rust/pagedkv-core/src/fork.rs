//! Forking a process while a manager's hash worker (`background_hashing`)
//! runs. A child process has no copy of the worker's thread: a prompt the
//! worker was hashing when the process forked would never be hashed there, and
//! whoever read its hashes in the child would wait forever.
//!
//! The forking thread calls [`prepare`] just before the fork: workers start no
//! new job from then on, and it waits until none is running. Every prompt
//! then is either hashed or untaken, and whoever needs an untaken prompt's
//! hashes computes them itself ([`crate::request`]'s jobs already work that
//! way). After the fork, [`parent_resumes`] lets the parent's workers go on;
//! [`child_starts`] marks every worker the child inherited as left behind: the
//! child neither uses nor joins them (their thread and channel stayed in the
//! parent) and starts a new worker when it next hashes a prompt.
//!
//! Lock-free (atomics only), so a fork at any moment leaves nothing locked in
//! the child that it would wait on.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// A fork is about to happen: workers start no new job.
static FORK_PENDING: AtomicBool = AtomicBool::new(false);
/// Jobs running on workers now.
static RUNNING: AtomicUsize = AtomicUsize::new(0);
/// Forks this process has gone through as a child: a worker spawned in an
/// earlier generation is the parent's.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// How long a worker naps while a fork is pending.
const GATE_NAP: Duration = Duration::from_micros(200);

/// Called by a worker before it runs a job: waits while a fork is pending, then
/// counts the job as running until [`leave_job`].
pub(crate) fn enter_job() {
    loop {
        if !FORK_PENDING.load(SeqCst) {
            RUNNING.fetch_add(1, SeqCst);
            // Checked again after counting: `prepare` sets the flag, then reads
            // the count, so one of the two sees the other.
            if !FORK_PENDING.load(SeqCst) {
                return;
            }
            RUNNING.fetch_sub(1, SeqCst);
        }
        std::thread::sleep(GATE_NAP);
    }
}

/// The job [`enter_job`] counted has finished.
pub(crate) fn leave_job() {
    RUNNING.fetch_sub(1, SeqCst);
}

/// The current generation (a worker records the one it was spawned in).
pub(crate) fn generation() -> u64 {
    GENERATION.load(SeqCst)
}

/// Before a fork: workers start no new job, and this waits up to `timeout`
/// for the running ones to finish. `true` once none runs; `false` on timeout
/// (the flag stays set: call again, or [`parent_resumes`] to give up).
pub fn prepare(timeout: Duration) -> bool {
    FORK_PENDING.store(true, SeqCst);
    let deadline = Instant::now() + timeout;
    loop {
        if RUNNING.load(SeqCst) == 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// After a fork, in the parent (or after a failed fork): workers go on.
pub fn parent_resumes() {
    FORK_PENDING.store(false, SeqCst);
}

/// After a fork, in the child: every worker inherited is the parent's; the
/// child's managers hash their pending prompts themselves and start new
/// workers.
pub fn child_starts() {
    GENERATION.fetch_add(1, SeqCst);
    RUNNING.store(0, SeqCst);
    FORK_PENDING.store(false, SeqCst);
}
