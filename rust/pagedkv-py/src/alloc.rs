//! The module's own heap: what Rust allocates in it (the manager's requests,
//! their tokens and block hashes, block lists, result buffers) below a
//! mebibyte comes from mimalloc, the rest from the system allocator.
//!
//! mimalloc's size-class pages keep a request's buffers and its neighbours'
//! close together and its frees cheap: a step that reads a hundred requests'
//! state after the Python scheduler has left the caches cold costs less (see
//! BENCHMARKS.md, "The module's allocator"). Blocks of a mebibyte and more (a
//! large pool's arrays and prefix map, the hash memo) go to the system
//! allocator, whose `mmap` the kernel refuses when it cannot back it: mimalloc
//! maps with `MAP_NORESERVE`, so a pool larger than the machine would be
//! granted and the process killed when it is first written, instead of the
//! manager reporting that it cannot be allocated. Python's objects and
//! `NumPy`'s arrays stay on their own allocators. mimalloc's thread-local
//! state uses the dynamic model, for a module loaded by `dlopen`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};

use mimalloc::MiMalloc;

/// Blocks of this many bytes and more come from the system allocator.
const LARGE: usize = 1 << 20;

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
