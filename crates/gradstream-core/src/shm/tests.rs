//! Rings passed between the two ends of a socket pair, and what a hostile peer passes
//! instead: each refused before anything is mapped.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::fs::{MemfdFlags, SealFlags};

use super::*;
use crate::error::GradientStreamError;

const LEN: usize = 256 << 10;

/// `fd` passed through a socket pair: the receiving end's copy of it.
fn passed(fd: std::os::fd::BorrowedFd<'_>) -> OwnedFd {
    let (a, b) = UnixStream::pair().unwrap();
    assert_eq!(send_with_fd(&a, b"r", fd).unwrap(), 1);
    let mut buf = [0u8; 8];
    let (n, got) = recv_with_fd(&b, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"r");
    got.expect("the descriptor came with the byte")
}

/// A memfd of `len` bytes with `seals` added.
fn memfd(len: usize, seals: SealFlags) -> OwnedFd {
    let fd = rustix::fs::memfd_create("hostile", MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len as u64).unwrap();
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

fn refusal(got: crate::error::Result<PeerRing>) -> String {
    match got {
        Err(e @ GradientStreamError::Protocol { .. }) => e.to_string(),
        Err(other) => panic!("refused, but not as a protocol error: {other}"),
        Ok(_) => panic!("a hostile ring was mapped"),
    }
}

fn sealed() -> SealFlags {
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE
}

#[test]
fn bytes_written_in_a_ring_come_out_of_the_peers_mapping_wrapping_at_its_end() {
    let mut own = OwnRing::create(LEN).unwrap();
    let peer = PeerRing::adopt(passed(own.fd()), &RingLimits::default()).unwrap();
    assert_eq!((own.len(), peer.len()), (LEN, LEN));
    let bytes: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
    for offset in [0, 1000, LEN - 10, LEN + 5, 3 * LEN - 99_999] {
        own.write_at(offset, &bytes);
        let mut out = vec![0u8; bytes.len()];
        peer.copy_out(offset, &mut out);
        assert_eq!(out, bytes, "at offset {offset}");
    }
}

#[test]
fn an_own_ring_cannot_be_resized_written_or_punched_through_the_descriptor_passed() {
    let mut own = OwnRing::create(LEN).unwrap();
    let seals = rustix::fs::fcntl_get_seals(own.fd()).unwrap();
    assert!(seals.contains(sealed() | SealFlags::SEAL));
    let theirs = passed(own.fd());
    assert!(rustix::fs::ftruncate(&theirs, 4096).is_err());
    assert!(rustix::fs::ftruncate(&theirs, (2 * LEN) as u64).is_err());
    assert!(rustix::io::pwrite(&theirs, b"x", 0).is_err());
    let punch = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
    assert!(rustix::fs::fallocate(&theirs, punch, 0, LEN as u64).is_err());
    // This side still writes through its own mapping.
    own.write_at(0, b"still ours");
    let peer = PeerRing::adopt(theirs, &RingLimits::default()).unwrap();
    let mut out = [0u8; 10];
    peer.copy_out(0, &mut out);
    assert_eq!(&out, b"still ours");
}

#[test]
fn a_ring_size_that_is_not_whole_pages_or_too_small_is_not_made() {
    for len in [0, 4096, MIN_RING_LEN + 1] {
        let error = OwnRing::create(len).err().expect("refused").to_string();
        assert!(error.contains("multiple of the page size"), "{error}");
    }
}

#[test]
fn a_memfd_without_the_size_seals_is_refused() {
    let limits = RingLimits::default();
    let error = refusal(PeerRing::adopt(memfd(LEN, SealFlags::empty()), &limits));
    assert!(error.contains("without F_SEAL_SHRINK"), "{error}");
    let error = refusal(PeerRing::adopt(memfd(LEN, SealFlags::SHRINK), &limits));
    assert!(error.contains("without F_SEAL_GROW"), "{error}");
    // Sealed only against writes: still resizable, refused.
    let error = refusal(PeerRing::adopt(memfd(LEN, SealFlags::WRITE), &limits));
    assert!(error.contains("without F_SEAL_SHRINK"), "{error}");
    // Fixed in size but open to hole punching.
    let error = refusal(PeerRing::adopt(
        memfd(LEN, SealFlags::SHRINK | SealFlags::GROW),
        &limits,
    ));
    assert!(error.contains("without F_SEAL_FUTURE_WRITE"), "{error}");
}

#[test]
fn a_hugetlbfs_memfd_is_refused_whatever_its_seals() {
    // Its pages come from a pool (none here): a page that cannot be had is a SIGBUS.
    let flags = MemfdFlags::ALLOW_SEALING | MemfdFlags::HUGETLB;
    let fd = rustix::fs::memfd_create("huge", flags).expect("a hugetlbfs memfd");
    rustix::fs::ftruncate(&fd, 2 << 20).unwrap();
    let _ = rustix::fs::fcntl_add_seals(&fd, sealed());
    let error = refusal(PeerRing::adopt(fd, &RingLimits { max_len: 4 << 20 }));
    assert!(error.contains("another filesystem than tmpfs"), "{error}");
}

#[test]
fn a_ring_past_this_sides_limit_is_refused_before_it_is_mapped() {
    assert_eq!(RingLimits::default().max_len, DEFAULT_RING_LEN);
    let limits = RingLimits { max_len: LEN };
    PeerRing::adopt(memfd(LEN, sealed()), &limits).unwrap();
    let error = refusal(PeerRing::adopt(memfd(2 * LEN, sealed()), &limits));
    assert!(
        error.contains(&format!("a ring of {} bytes", 2 * LEN)),
        "{error}"
    );
    // Not whole pages, and too small.
    for len in [LEN - 1, 4096] {
        let error = refusal(PeerRing::adopt(memfd(len, sealed()), &limits));
        assert!(error.contains(&format!("a ring of {len} bytes")), "{error}");
    }
}

#[test]
fn descriptors_of_other_kinds_are_refused() {
    let limits = RingLimits::default();
    let (read, _write) = rustix::pipe::pipe().unwrap();
    let error = refusal(PeerRing::adopt(read, &limits));
    assert!(error.contains("another kind"), "{error}");
    let (socket, _other) = UnixStream::pair().unwrap();
    let error = refusal(PeerRing::adopt(OwnedFd::from(socket), &limits));
    assert!(error.contains("another kind"), "{error}");
    // Regular files that are not memfds, on tmpfs (without the seals: this kernel lets
    // a tmpfs file report seals, none of them set) and on the temporary directory's disk.
    for folder in [std::path::PathBuf::from("/dev/shm"), std::env::temp_dir()] {
        let path = folder.join(format!("gradstream-ring-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(LEN as u64).unwrap();
        std::fs::remove_file(&path).unwrap();
        let error = refusal(PeerRing::adopt(OwnedFd::from(file), &limits));
        let named = [
            "cannot carry seals",
            "without F_SEAL_SHRINK",
            "another filesystem",
        ];
        assert!(named.iter().any(|says| error.contains(says)), "{error}");
    }
}

#[test]
fn a_message_with_two_descriptors_is_refused_and_both_closed() {
    let (a, b) = UnixStream::pair().unwrap();
    let (one, two) = (memfd(LEN, sealed()), memfd(LEN, sealed()));
    let fds = [one.as_fd(), two.as_fd()];
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
    assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
    rustix::net::sendmsg(
        &a,
        &[std::io::IoSlice::new(b"x")],
        &mut control,
        rustix::net::SendFlags::empty(),
    )
    .unwrap();
    let mut buf = [0u8; 8];
    let error = recv_with_fd(&b, &mut buf).expect_err("refused").to_string();
    assert!(error.contains("more descriptors than one"), "{error}");
    // Only the originals still refer to either memfd (other tests open descriptors of
    // their own meanwhile: counted by inode, not in all).
    for fd in [&one, &two] {
        assert_eq!(descriptors_of(fd), 1, "a received descriptor was left open");
    }
}

#[test]
fn a_message_without_a_descriptor_gives_none() {
    let (a, b) = UnixStream::pair().unwrap();
    std::io::Write::write_all(&mut &a, b"plain").unwrap();
    let mut buf = [0u8; 8];
    let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
    assert_eq!((&buf[..n], fd.is_none()), (&b"plain"[..], true));
}

/// How many of this process's open descriptors refer to `fd`'s file.
fn descriptors_of(fd: &OwnedFd) -> usize {
    use std::os::unix::fs::MetadataExt;
    let target = rustix::fs::fstat(fd).unwrap();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::metadata(entry.ok()?.path()).ok())
        .filter(|m| m.ino() == target.st_ino && m.dev() == target.st_dev)
        .count()
}
