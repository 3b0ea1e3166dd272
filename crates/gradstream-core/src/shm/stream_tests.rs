//! Bytes both ways through `ShmStream`s on a socket pair, rings smaller than what moves
//! (so writes wait for credits and wrap), and hostile peers: a raw socket end that sets up
//! a ring of its own, then lies in its control messages.

use std::io::Write;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use rustix::fs::{MemfdFlags, SealFlags};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::*;
use crate::direct::Direct;

const RING: usize = 64 << 10;

fn pair() -> (tokio::net::UnixStream, std::os::unix::net::UnixStream) {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    (tokio::net::UnixStream::from_std(ours).unwrap(), theirs)
}

/// Deterministic bytes, different per `seed`.
fn bytes(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// `bytes` written as two slices of vectored writes until all of it went.
async fn write_all_vectored(to: &mut (impl tokio::io::AsyncWrite + Unpin), bytes: &[u8]) {
    let mut done = 0;
    while done < bytes.len() {
        let mid = done.max(bytes.len() / 2);
        let slices = [
            std::io::IoSlice::new(&bytes[done..mid]),
            std::io::IoSlice::new(&bytes[mid..]),
        ];
        done += to.write_vectored(&slices).await.unwrap();
    }
}

async fn opened() -> (ShmStream, ShmStream) {
    let (a, b) = tokio::net::UnixStream::pair().unwrap();
    let limits = RingLimits::default();
    let (a, b) = tokio::join!(
        ShmStream::open(a, RING, &limits),
        ShmStream::open(b, RING, &limits)
    );
    (a.unwrap(), b.unwrap())
}

#[tokio::test]
async fn bytes_go_both_ways_at_once_through_rings_smaller_than_them() {
    let (a, b) = opened().await;
    let (mut a_read, mut a_write) = tokio::io::split(a);
    let (mut b_read, mut b_write) = tokio::io::split(b);
    let there = bytes(1 << 20, 1);
    let back = bytes(700_001, 2);
    let (t, k) = (there.clone(), back.clone());
    let writes = async move {
        // Pieces of uneven sizes, every other one as two slices of a vectored write.
        let sizes = [1usize, 10, 4096, 65_536, 100_000];
        let (mut at, mut i) = (0, 0);
        while at < t.len() {
            let end = (at + sizes[i % sizes.len()]).min(t.len());
            if i % 2 == 0 {
                a_write.write_all(&t[at..end]).await.unwrap();
            } else {
                write_all_vectored(&mut a_write, &t[at..end]).await;
            }
            (at, i) = (end, i + 1);
        }
        a_write.shutdown().await.unwrap();
        b_write.write_all(&k).await.unwrap();
        b_write.shutdown().await.unwrap();
    };
    let reads = async move {
        let mut got_there = Vec::new();
        let mut got_back = Vec::new();
        let (x, y) = tokio::join!(
            b_read.read_to_end(&mut got_there),
            a_read.read_to_end(&mut got_back)
        );
        x.unwrap();
        y.unwrap();
        (got_there, got_back)
    };
    let ((), (got_there, got_back)) = tokio::join!(writes, reads);
    assert!(got_there == there, "the bytes one way differ");
    assert!(got_back == back, "the bytes the other way differ");
}

/// A hostile end: sets up a sealed ring of `len` bytes (or what `fd_of` makes), then
/// writes `then` raw on the socket.
fn hostile_setup(theirs: &std::os::unix::net::UnixStream, said: u64, seals: SealFlags) {
    let fd = rustix::fs::memfd_create("hostile", MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, RING as u64).unwrap();
    rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    let mut setup = [0u8; 16];
    setup[..8].copy_from_slice(b"gsring1\0");
    setup[8..].copy_from_slice(&said.to_le_bytes());
    assert_eq!(send_with_fd(theirs, &setup, fd.as_fd()).unwrap(), 16);
}

fn control(kind: u32, n: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..4].copy_from_slice(&kind.to_le_bytes());
    out[8..].copy_from_slice(&n.to_le_bytes());
    out
}

async fn read_error(mut stream: ShmStream) -> String {
    let mut buf = vec![0u8; 1024];
    let error = stream.read(&mut buf).await.expect_err("a lie was believed");
    error.to_string()
}

#[tokio::test]
async fn a_peer_that_announces_more_than_its_ring_holds_is_refused() {
    let (ours, mut theirs) = pair();
    hostile_setup(
        &theirs,
        RING as u64,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
    );
    theirs.write_all(&control(1, RING as u64 - 10)).unwrap();
    theirs.write_all(&control(1, 11)).unwrap();
    let stream = ShmStream::open(ours, RING, &RingLimits::default())
        .await
        .unwrap();
    let error = read_error(stream).await;
    assert!(error.contains("11 more bytes announced"), "{error}");
}

#[tokio::test]
async fn a_peer_that_releases_bytes_never_written_is_refused() {
    let (ours, mut theirs) = pair();
    hostile_setup(
        &theirs,
        RING as u64,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
    );
    theirs.write_all(&control(2, 1)).unwrap();
    let stream = ShmStream::open(ours, RING, &RingLimits::default())
        .await
        .unwrap();
    let error = read_error(stream).await;
    assert!(
        error.contains("1 bytes released of 0 outstanding"),
        "{error}"
    );
}

#[tokio::test]
async fn unknown_or_malformed_control_messages_are_refused() {
    for (message, says) in [
        (control(3, 1), "a message of kind 3"),
        (control(1, 0), "0 more bytes announced"),
        (
            {
                let mut m = control(1, 1);
                m[5] = 1;
                m
            },
            "control message",
        ),
    ] {
        let (ours, mut theirs) = pair();
        hostile_setup(
            &theirs,
            RING as u64,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
        );
        theirs.write_all(&message).unwrap();
        let stream = ShmStream::open(ours, RING, &RingLimits::default())
            .await
            .unwrap();
        let error = read_error(stream).await;
        assert!(error.contains(says), "{error}");
    }
}

#[tokio::test]
async fn a_setup_that_lies_about_its_ring_or_has_none_is_refused() {
    let limits = RingLimits::default();
    // A size that is not the ring's.
    let (ours, theirs) = pair();
    hostile_setup(
        &theirs,
        2 * RING as u64,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
    );
    let error = ShmStream::open(ours, RING, &limits)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(error.contains("said to be"), "{error}");
    // An unsealed ring.
    let (ours, theirs) = pair();
    hostile_setup(&theirs, RING as u64, SealFlags::WRITE);
    let error = ShmStream::open(ours, RING, &limits)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(error.contains("without F_SEAL_SHRINK"), "{error}");
    // No descriptor at all, and another protocol's bytes.
    for (setup, says) in [
        (*b"gsring1\0\0\0\x01\0\0\0\0\0", "without a descriptor"),
        (*b"GET / HTTP/1.1\r\n", "setup message"),
    ] {
        let (ours, mut theirs) = pair();
        theirs.write_all(&setup).unwrap();
        let error = ShmStream::open(ours, RING, &limits)
            .await
            .err()
            .expect("refused")
            .to_string();
        assert!(error.contains(says), "{error}");
    }
    // The end of the connection before a setup.
    let (ours, theirs) = pair();
    drop(theirs);
    let error = ShmStream::open(ours, RING, &limits)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        error.contains("end of the connection") || error.contains("Broken pipe"),
        "{error}"
    );
}

#[tokio::test]
async fn what_a_peer_announced_before_it_went_away_is_read_to_the_end() {
    let (mut a, mut b) = opened().await;
    let sent = bytes(RING, 3);
    // A whole ring in pieces, announced, then the writer's end dropped: the reader's
    // credits then reach nobody, and every byte still comes out, then the end.
    for piece in sent.chunks(10_000) {
        a.write_all(piece).await.unwrap();
    }
    a.flush().await.unwrap();
    drop(a);
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1000];
    loop {
        let n = b.read(&mut buf).await.expect("reads what was announced");
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got == sent,
        "{} of {} bytes came out",
        got.len(),
        sent.len()
    );
}

#[tokio::test]
async fn a_reader_and_a_writer_in_two_tasks_each_get_the_message_the_other_took() {
    // The reader of `b` waits for data while its writer, in another task, waits for room
    // in a full ring: the peer's messages arrive in either one's poll, and both go on.
    let (mut a, b) = opened().await;
    let (mut b_read, mut b_write) = tokio::io::split(b);
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        b_read.read_to_end(&mut got).await.map(|_| got)
    });
    tokio::task::yield_now().await;
    let big = bytes(3 * RING, 4);
    let expected = big.clone();
    let writer = tokio::spawn(async move {
        b_write.write_all(&big).await?;
        b_write.shutdown().await
    });
    tokio::task::yield_now().await;
    let small = bytes(100, 5);
    a.write_all(&small).await.unwrap();
    a.shutdown().await.unwrap();
    let mut got = Vec::new();
    a.read_to_end(&mut got).await.unwrap();
    assert!(got == expected, "the writer's bytes differ");
    let wait = std::time::Duration::from_secs(10);
    let read = tokio::time::timeout(wait, reader)
        .await
        .expect("the reader was woken");
    assert_eq!(read.unwrap().unwrap(), small);
    tokio::time::timeout(wait, writer)
        .await
        .expect("the writer was woken")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_peer_that_closes_with_credits_unread_still_gets_its_bytes_read() {
    // The reader's credits sit unread in the peer's socket when it closes: the reader's
    // socket then reports a reset, after the messages that came before it.
    let (mut a, mut b) = opened().await;
    let sent = bytes(RING, 6);
    b.write_all(&sent).await.unwrap();
    let mut first = vec![0u8; RING / 4];
    a.read_exact(&mut first).await.unwrap();
    b.shutdown().await.unwrap();
    drop(b);
    let mut rest = Vec::new();
    a.read_to_end(&mut rest)
        .await
        .expect("reads what was announced");
    first.extend_from_slice(&rest);
    assert!(
        first == sent,
        "{} of {} bytes came out",
        first.len(),
        sent.len()
    );
}

#[tokio::test]
async fn a_descriptor_that_comes_after_the_setups_first_byte_is_refused() {
    let (ours, mut theirs) = pair();
    let fd = rustix::fs::memfd_create("late", MemfdFlags::ALLOW_SEALING).unwrap();
    let mut setup = [0u8; 16];
    setup[..8].copy_from_slice(b"gsring1\0");
    setup[8..].copy_from_slice(&(RING as u64).to_le_bytes());
    theirs.write_all(&setup[..8]).unwrap();
    let opening =
        tokio::spawn(async move { ShmStream::open(ours, RING, &RingLimits::default()).await });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(send_with_fd(&theirs, &setup[8..], fd.as_fd()).unwrap(), 8);
    let error = opening.await.unwrap().err().expect("refused").to_string();
    assert!(error.contains("a descriptor later in the setup"), "{error}");
}

/// What is verified is what is returned: a hostile sender announces a gradient's frames
/// in its ring, then keeps rewriting them through its own writable mapping (made before
/// it sealed the ring against new writes), flipping each payload byte to garbage and
/// back. The reader copies out of the ring before it checks a CRC, so every receive ends
/// in a refused frame or in exactly the values sent; never in values that passed a check
/// and then changed under it (a reader that checked the shared bytes and then copied
/// them would hand back garbage here).
#[test]
fn a_sender_rewriting_its_ring_after_announcing_cannot_change_what_is_received() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    let session = crate::GradientStreamSession::new("scribbled", 1024);
    let gradient: Vec<f32> = (0..4096).map(|i| (i as f32).sin()).collect();
    let frames = session.config().encode_frames(&gradient[..]).unwrap();
    assert!(
        frames.len() < RING,
        "the frames fit the ring in one announcement"
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut exact, mut refused) = (0, 0);
    for _ in 0..40 {
        let (ours, mut theirs) = runtime.block_on(async { pair() });
        let fd = rustix::fs::memfd_create("scribbler", MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, RING as u64).unwrap();
        // SAFETY: a fresh memfd of RING bytes, mapped shared for this test's writes; it
        // is sealed against shrinking before any reader maps it, and unmapped below
        // after the scribbler stopped.
        let at = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                RING,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .unwrap() as usize;
        // SAFETY: `at` maps RING bytes, writable, and `frames` is shorter; the mapping
        // is fresh from the kernel, so it cannot overlap `frames` (on the heap), and no
        // other thread knows of it yet.
        unsafe { std::ptr::copy_nonoverlapping(frames.as_ptr(), at as *mut u8, frames.len()) };
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
        )
        .unwrap();
        let mut setup = [0u8; 16];
        setup[..8].copy_from_slice(b"gsring1\0");
        setup[8..].copy_from_slice(&(RING as u64).to_le_bytes());
        send_with_fd(&theirs, &setup, fd.as_fd()).unwrap();
        theirs.write_all(&control(1, frames.len() as u64)).unwrap();
        theirs.write_all(&control(3, 0)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicUsize::new(0));
        let scribbler = {
            let (stop, rounds) = (Arc::clone(&stop), Arc::clone(&rounds));
            let (len, original) = (frames.len(), frames.clone());
            std::thread::spawn(move || {
                let mut round = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    // Past the first frame's header, so most rewrites land in payloads;
                    // each bad byte stays for a stretch that varies from round to round.
                    let i = 16 + (round.wrapping_mul(7919) % (len - 16));
                    let garbage = original[i] ^ 0x5a;
                    // SAFETY: `i < len <= RING`, and the mapping lives until this thread
                    // is joined. These writes race the reader's copy out of its own
                    // read-only mapping of the same memfd, by design: to the reader that
                    // memory is the peer's, outside its control, and `PeerRing` only
                    // ever reads it through raw pointers into memory of its own.
                    // Volatile, so the compiler neither elides nor merges them.
                    unsafe {
                        let byte = (at as *mut u8).add(i);
                        std::ptr::write_volatile(byte, garbage);
                        for _ in 0..(round % 64) {
                            std::hint::spin_loop();
                        }
                        std::ptr::write_volatile(byte, original[i]);
                    }
                    round += 1;
                    rounds.store(round, Ordering::Relaxed);
                }
            })
        };
        // The receive starts once the scribbler runs.
        while rounds.load(Ordering::Relaxed) < 1000 {
            std::hint::spin_loop();
        }
        let got = runtime.block_on(async {
            let mut stream = ShmStream::open(ours, RING, &RingLimits::default()).await?;
            session.receive_from(&mut stream).await
        });
        stop.store(true, Ordering::Relaxed);
        scribbler.join().unwrap();
        // SAFETY: mapped above with this length; the scribbler, its only other user,
        // was joined.
        unsafe { rustix::mm::munmap(at as *mut std::ffi::c_void, RING).unwrap() };
        match got {
            Ok(values) => {
                assert!(
                    values
                        .iter()
                        .map(|v| v.to_bits())
                        .eq(gradient.iter().map(|v| v.to_bits())),
                    "a receive returned values other than those sent"
                );
                exact += 1;
            }
            Err(error) => {
                let text = error.to_string().to_lowercase();
                assert!(
                    text.contains("checksum") || text.contains("frame") || text.contains("chunk"),
                    "a rewrite was refused for another reason: {text}"
                );
                refused += 1;
            }
        }
    }
    eprintln!("{exact} receives exact, {refused} refused");
    // The rewrites did meet receives: otherwise this test showed nothing.
    assert!(
        refused > 0,
        "no rewrite landed during a receive ({exact} exact)"
    );
}

/// A one-way stream of small writes (no message of the reader's own for its credits to
/// ride with): credits still go out, once a quarter of the ring was read, and the writer
/// never waits for one that is not coming.
#[tokio::test]
async fn a_one_way_stream_of_small_writes_gets_its_credits_without_a_reply() {
    let (mut a, mut b) = opened().await;
    let sent = bytes(10 * RING + 7, 7);
    let expected = sent.clone();
    let writer = tokio::spawn(async move {
        for piece in sent.chunks(100) {
            a.write_all(piece).await.unwrap();
        }
        a.shutdown().await.unwrap();
        a
    });
    let mut got = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(20), b.read_to_end(&mut got))
        .await
        .expect("the writer waited for a credit that never came")
        .unwrap();
    writer.await.unwrap();
    assert!(got == expected, "{} of {} bytes", got.len(), expected.len());
}

/// The control messages a raw end reads from `theirs` now (none: an empty vec).
fn controls_now(theirs: &std::os::unix::net::UnixStream) -> Vec<(u32, u64)> {
    let mut buf = [0u8; 256];
    let n = match rustix::net::recv(theirs, &mut buf[..], rustix::net::RecvFlags::DONTWAIT) {
        Ok((n, _)) => n,
        Err(rustix::io::Errno::AGAIN) => 0,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(n % 16, 0, "a control message came in pieces");
    buf[..n]
        .chunks(16)
        .map(|m| {
            let kind = u32::from_le_bytes([m[0], m[1], m[2], m[3]]);
            let mut count = [0u8; 8];
            count.copy_from_slice(&m[8..]);
            (kind, u64::from_le_bytes(count))
        })
        .collect()
}

/// A small message read costs the reader no control message of its own: the credit for
/// it goes out with the reader's next message, in the same write (`DATA` then `CREDIT`).
#[tokio::test]
async fn a_small_message_read_is_credited_with_the_readers_next_message() {
    let (ours, mut theirs) = pair();
    hostile_setup(
        &theirs,
        RING as u64,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
    );
    theirs.write_all(&control(1, 100)).unwrap(); // DATA: 100 bytes of its ring
    let mut stream = ShmStream::open(ours, RING, &RingLimits::default())
        .await
        .unwrap();
    let mut setup = [0u8; 16];
    let (n, fd) = recv_with_fd(&theirs, &mut setup).unwrap();
    assert!(n == 16 && fd.is_some(), "the stream's own setup");
    let mut got = [0u8; 100];
    stream.read_exact(&mut got).await.unwrap();
    assert_eq!(
        controls_now(&theirs),
        vec![],
        "a credit of its own for 100 bytes"
    );
    stream.write_all(b"ack").await.unwrap();
    assert_eq!(controls_now(&theirs), vec![(1, 3), (2, 100)]);
}

/// Poll `f` on this thread until it is ready, waiting on `fd` for what the stream
/// recorded in `direct` (as the bindings' caller-thread driver does); a poll that is
/// pending with nothing recorded would leave such a caller waiting for nothing.
fn drive<T>(
    fd: std::os::fd::RawFd,
    direct: &Direct,
    mut f: impl FnMut(&mut Context<'_>) -> Poll<std::io::Result<T>>,
) -> T {
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(result) = f(&mut cx) {
            return result.unwrap();
        }
        let (read, write) = direct.take_wants();
        assert!(read || write, "pending with nothing to wait for");
        let events = if read { libc::POLLIN } else { 0 } | if write { libc::POLLOUT } else { 0 };
        let mut fds = [libc::pollfd {
            fd,
            events,
            revents: 0,
        }];
        // SAFETY: `fds` is one live pollfd; `fd` is the stream's open socket.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 1, 5000) };
        assert!(ready > 0, "the socket did not become ready in 5 s");
    }
}

/// A caller's thread drives one end by system calls (its socket off tokio's reactor),
/// through several rings' worth of bytes and their credits; then the end goes back to
/// tokio and reads the peer's answer there.
#[tokio::test]
async fn a_caller_thread_drives_the_stream_directly_then_hands_it_back() {
    let (mut a, mut b) = opened().await;
    let direct = Direct::default();
    let fd = a.go_direct(direct.clone(), true).expect("the socket");
    let sent = bytes(5 * RING + 3, 8);
    let expected = sent.clone();
    let peer = tokio::spawn(async move {
        let mut got = vec![0u8; expected.len()];
        b.read_exact(&mut got).await.unwrap();
        assert!(got == expected, "the bytes differ");
        b.write_all(b"ok").await.unwrap();
        b
    });
    let on_thread = direct.clone();
    let mut a = tokio::task::spawn_blocking(move || {
        let mut at = 0;
        while at < sent.len() {
            at += drive(fd, &on_thread, |cx| {
                Pin::new(&mut a).poll_write(cx, &sent[at..])
            });
        }
        drive(fd, &on_thread, |cx| Pin::new(&mut a).poll_flush(cx));
        a
    })
    .await
    .unwrap();
    direct.off();
    let mut answer = [0u8; 2];
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        a.read_exact(&mut answer),
    )
    .await
    .expect("back on tokio's reactor, the answer was seen")
    .unwrap();
    assert_eq!(&answer, b"ok");
    drop(peer.await.unwrap());
}

/// Back on tokio's reactor after a parked direct phase in which its socket was never
/// polled through tokio, a stream written once with no waiting (as an ack is written by
/// `Link::send_settled_now`) puts the message on the socket at once: tokio's readiness
/// for a socket just registered is not waited for.
#[tokio::test]
async fn a_stream_back_from_a_parked_phase_announces_a_write_at_once() {
    let (mut a, mut b) = opened().await;
    let direct = Direct::default();
    a.go_direct(direct.clone(), true).expect("the socket");
    direct.off();
    let mut cx = Context::from_waker(Waker::noop());
    let wrote = Pin::new(&mut a).poll_write(&mut cx, b"ack");
    assert!(matches!(wrote, Poll::Ready(Ok(3))), "{wrote:?}");
    let mut got = [0u8; 3];
    tokio::time::timeout(std::time::Duration::from_secs(5), b.read_exact(&mut got))
        .await
        .expect("the write was announced without another poll")
        .unwrap();
    assert_eq!(&got, b"ack");
}

/// A stream whose socket is parked, polled through tokio's path outside the runtime (it
/// cannot be put back on a reactor there): an error naming that, not a hang or a panic.
#[test]
fn a_parked_stream_polled_outside_the_runtime_is_an_error() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut a, _b) = runtime.block_on(opened());
    let direct = Direct::default();
    a.go_direct(direct.clone(), true).expect("the socket");
    direct.off();
    let mut cx = Context::from_waker(Waker::noop());
    let Poll::Ready(Err(error)) = Pin::new(&mut a).poll_write(&mut cx, b"x") else {
        panic!("a parked stream was polled through tokio outside the runtime");
    };
    assert!(
        error
            .to_string()
            .contains("polled outside the tokio runtime"),
        "{error}"
    );
}
