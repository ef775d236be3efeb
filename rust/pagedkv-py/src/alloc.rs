//! The module's own heap: what Rust allocates in it below 16 KiB (the
//! manager's request records and ids, block lists, the hash vectors of most
//! prompts, result buffers) comes from mimalloc, the rest (token buffers of
//! longer prompts, a pool's arrays and prefix map, the hash memo) from the
//! system allocator.
//!
//! mimalloc's size-class pages keep the many small blocks of a hundred running
//! requests close together and its frees cheap: a step that reads their state
//! after the Python scheduler has left the caches cold costs less (see
//! docs/perf-log.md, "Prompts that begin like a live request, and the module's
//! allocator"). Larger blocks stay with the system allocator, for two
//! reasons. mimalloc gave blocks of a freed prompt's size fresh memory more
//! often than the system allocator, which reuses the freed chunk: page faults
//! (huge ones, with transparent huge pages) inside a step, and some processes
//! markedly slower than others. And the system allocator's `mmap` is refused
//! when the kernel cannot back it, where mimalloc maps with `MAP_NORESERVE`:
//! a pool larger than the machine would be granted and the process killed
//! when it is first written, instead of the manager reporting that it cannot
//! be allocated. Python's objects and `NumPy`'s arrays stay on their own
//! allocators. mimalloc's thread-local state uses the dynamic model, for a
//! module loaded by `dlopen`.
//!
//! mimalloc returns the memory of pages left empty to the OS a second after
//! they empty (its `purge_delay`); a page reused after that faults again, a
//! 2 MiB huge page at a time where transparent huge pages are on, each fault
//! zeroing it inside a manager call. The module keeps them instead
//! ([`keep_freed_pages`]): its small blocks are a live request's records, so
//! what it holds is bounded by the most requests it held at once.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};

use mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its `mimalloc.h`, version 3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tells mimalloc never to return the module's empty pages to the OS (see the
/// module docs), unless `MIMALLOC_PURGE_DELAY` in the environment says
/// otherwise. Called when the module loads.
pub fn keep_freed_pages() {
    // SAFETY: sets an option's value; takes no pointers, and mimalloc reads
    // its options at any time.
    unsafe { libmimalloc_sys::mi_option_set_default(MI_OPTION_PURGE_DELAY, -1) }
}

/// Blocks of this many bytes and more come from the system allocator.
const LARGE: usize = 16 << 10;

/// mimalloc below [`LARGE`] bytes, the system allocator from there.
pub struct ModuleAlloc;

// SAFETY: every call goes to one of two allocators chosen by the block's size
// alone, so a block is freed and resized by the allocator that made it; a
// resize across the threshold allocates on the other side, copies and frees.
unsafe impl GlobalAlloc for ModuleAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            if layout.size() >= LARGE {
                System.alloc(layout)
            } else {
                MiMalloc.alloc(layout)
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            if layout.size() >= LARGE {
                System.alloc_zeroed(layout)
            } else {
                MiMalloc.alloc_zeroed(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated with `layout`, so by the allocator its
        // size chose here.
        unsafe {
            if layout.size() >= LARGE {
                System.dealloc(ptr, layout);
            } else {
                MiMalloc.dealloc(ptr, layout);
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (was_large, is_large) = (layout.size() >= LARGE, new_size >= LARGE);
        // SAFETY: the caller's contract (`ptr` allocated here with `layout`,
        // `new_size` non-zero and valid with its alignment) holds for the
        // allocator that made the block, and for the new layout.
        unsafe {
            match (was_large, is_large) {
                (false, false) => MiMalloc.realloc(ptr, layout, new_size),
                (true, true) => System.realloc(ptr, layout, new_size),
                _ => {
                    let new = Layout::from_size_align_unchecked(new_size, layout.align());
                    let out = self.alloc(new);
                    if !out.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, out, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    out
                }
            }
        }
    }
}
