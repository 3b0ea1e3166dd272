//! `KeptMemory` driven directly (an instance of each test's own, not the global one):
//! what is kept, what is reused, the bounds, and that contents survive a `realloc`.

use super::*;

const MIB: usize = 1 << 20;

fn bytes(n: usize) -> Layout {
    Layout::from_size_align(n, 1).unwrap()
}

/// Allocate `n` bytes from `memory` and write `fill` over all of them.
fn filled(memory: &KeptMemory, n: usize, fill: u8) -> *mut u8 {
    // SAFETY (tests): a valid non-zero layout; the block is written within its size.
    unsafe {
        let ptr = memory.alloc(bytes(n));
        assert!(!ptr.is_null());
        std::ptr::write_bytes(ptr, fill, n);
        ptr
    }
}

fn free(memory: &KeptMemory, ptr: *mut u8, n: usize) {
    // SAFETY (tests): a block of `memory` of `n` bytes, released once.
    unsafe { memory.dealloc(ptr, bytes(n)) }
}

#[test]
fn a_released_large_block_serves_the_next_allocation_of_about_its_size() {
    let memory = KeptMemory::new(64 * MIB);
    let first = filled(&memory, 8 * MIB, 1);
    free(&memory, first, 8 * MIB);
    let stats = memory.stats();
    assert_eq!((stats.blocks, stats.reused), (1, 0));
    assert!(stats.held >= 8 * MIB);
    // At least half its size: served from it.
    let second = filled(&memory, 5 * MIB, 2);
    assert_eq!(second, first);
    assert_eq!(memory.stats().reused, 1);
    assert_eq!(memory.stats().held, 0);
    free(&memory, second, 5 * MIB);
    // Less than half: not served from it (the block stays kept).
    let third = filled(&memory, KEEP_FROM, 3);
    assert_ne!(third, first);
    assert_eq!(memory.stats().blocks, 1);
    free(&memory, third, KEEP_FROM);
    // Larger than the block: not from it either.
    let fourth = filled(&memory, 12 * MIB, 4);
    assert_ne!(fourth, first);
    free(&memory, fourth, 12 * MIB);
    let held = memory.stats().held;
    assert!(held >= 8 * MIB + 12 * MIB);
    assert_eq!(memory.release(), held);
    assert_eq!((memory.stats().held, memory.stats().blocks), (0, 0));
}

#[test]
fn the_smallest_fitting_block_is_chosen() {
    let memory = KeptMemory::new(256 * MIB);
    let big = filled(&memory, 16 * MIB, 1);
    let small = filled(&memory, 9 * MIB, 2);
    free(&memory, big, 16 * MIB);
    free(&memory, small, 9 * MIB);
    let got = filled(&memory, 8 * MIB, 3);
    assert_eq!(got, small);
    free(&memory, got, 8 * MIB);
    memory.release();
}

#[test]
fn small_blocks_and_large_alignments_are_never_kept() {
    let memory = KeptMemory::new(256 * MIB);
    let small = filled(&memory, KEEP_FROM - 1, 1);
    free(&memory, small, KEEP_FROM - 1);
    let aligned = Layout::from_size_align(8 * MIB, 4096).unwrap();
    // SAFETY (tests): a valid layout, released with the same.
    unsafe {
        let ptr = memory.alloc(aligned);
        assert!(!ptr.is_null());
        memory.dealloc(ptr, aligned);
    }
    assert_eq!(memory.stats().blocks, 0);
}

#[test]
fn the_limit_bounds_what_is_held_and_the_oldest_go_first() {
    let memory = KeptMemory::new(20 * MIB);
    let blocks: Vec<_> = (0..3).map(|i| filled(&memory, 8 * MIB, i)).collect();
    for &b in &blocks {
        free(&memory, b, 8 * MIB);
    }
    let stats = memory.stats();
    // Two of about 8 MiB fit under 20 MiB, three do not.
    assert_eq!(stats.blocks, 2);
    assert!(stats.held <= 20 * MIB);
    // The oldest (the first released) went back; the newest is reused first or second.
    let a = filled(&memory, 8 * MIB, 9);
    let b = filled(&memory, 8 * MIB, 9);
    assert!(!([a, b].contains(&blocks[0])));
    assert!([a, b].contains(&blocks[1]) && [a, b].contains(&blocks[2]));
    free(&memory, a, 8 * MIB);
    free(&memory, b, 8 * MIB);
    // A block over the limit is not kept at all.
    let huge = filled(&memory, 24 * MIB, 1);
    free(&memory, huge, 24 * MIB);
    assert!(memory.stats().held <= 20 * MIB);
    memory.set_limit(0);
    assert_eq!((memory.stats().held, memory.stats().blocks), (0, 0));
    let again = filled(&memory, 8 * MIB, 1);
    free(&memory, again, 8 * MIB);
    assert_eq!(memory.stats().blocks, 0);
}

#[test]
fn no_more_than_slots_blocks_are_kept() {
    let memory = KeptMemory::new(usize::MAX);
    let blocks: Vec<_> = (0..SLOTS + 3)
        .map(|_| filled(&memory, KEEP_FROM, 0))
        .collect();
    for &b in &blocks {
        free(&memory, b, KEEP_FROM);
    }
    assert_eq!(memory.stats().blocks, SLOTS);
    memory.release();
    assert_eq!(memory.stats().blocks, 0);
}

#[test]
fn realloc_keeps_the_contents_whether_it_grows_in_place_into_a_kept_block_or_not() {
    let memory = KeptMemory::new(256 * MIB);
    // A kept block of 32 MiB to grow into.
    let room = filled(&memory, 32 * MIB, 0);
    free(&memory, room, 32 * MIB);
    let start = filled(&memory, MIB, 7);
    // SAFETY (tests): `start` is a live 1 MiB block of `memory`; each result is checked
    // and later released with its size.
    unsafe {
        let grown = memory.realloc(start, bytes(MIB), 20 * MIB);
        assert_eq!(grown, room);
        assert!(std::slice::from_raw_parts(grown, MIB)
            .iter()
            .all(|&b| b == 7));
        // Within its usable size: in place.
        let again = memory.realloc(grown, bytes(20 * MIB), 30 * MIB);
        assert_eq!(again, grown);
        assert!(std::slice::from_raw_parts(again, MIB)
            .iter()
            .all(|&b| b == 7));
        // Past it, with nothing kept: the system's realloc, contents kept.
        std::ptr::write_bytes(again, 5, 30 * MIB);
        let past = memory.realloc(again, bytes(30 * MIB), 40 * MIB);
        assert!(std::slice::from_raw_parts(past, 30 * MIB)
            .iter()
            .all(|&b| b == 5));
        free(&memory, past, 40 * MIB);
    }
    memory.release();
}

#[test]
fn threads_taking_and_keeping_at_once_never_share_a_block() {
    static MEMORY: KeptMemory = KeptMemory::new(64 * MIB);
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            std::thread::spawn(move || {
                for _ in 0..50 {
                    let ptr = filled(&MEMORY, 5 * MIB, t);
                    std::thread::yield_now();
                    // SAFETY (tests): our own live block of 5 MiB.
                    let mine = unsafe { std::slice::from_raw_parts(ptr, 5 * MIB) };
                    assert!(mine.iter().all(|&b| b == t), "a block was handed out twice");
                    free(&MEMORY, ptr, 5 * MIB);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(MEMORY.stats().reused > 0);
    MEMORY.release();
}
