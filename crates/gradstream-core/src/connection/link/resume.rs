//! Resume (docs/spec/protocol.md, "Resume"): after a failure of any of a link's streams
//! in a transfer (a reset, a stream ended, a wait for bytes out of time), every stream is
//! replaced: the side that dialled dials each again (with backoff), the listener's link
//! takes them from its session's channel, each proven with the session's secret (a resume
//! tag). Then each side tells the other where it stands as a receiver (`ResumeState`),
//! on the new first stream, and the transfer goes on: the sender sends what the receiver
//! does not hold. All of it within the listener's or the dialler's resume window, and
//! within the transfer's own bounds (its timeout and deadline).
//!
//! The old streams are kept open until the new ones are in: a listener that had not seen
//! the failure sees the resumed streams come, not its old ones end (which, between
//! transfers, would read as the peer's close).
//!
//! Uses `streams` (`Joined`, `SessionEntry`), `protocol::streams::ResumeState`; used by
//! `striped` and `link`.

use std::future::poll_fn;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::super::streams::{Joined, SessionEntry};
use super::*;
use crate::protocol::streams::{ResumeState, RESUME_LEN};

/// How a dialler dials stream `index` of its session again (a TCP connect, TLS, the
/// handshake with a resume hello, the proofs both ways).
pub type Redial = std::sync::Arc<dyn Fn(u8) -> Dialling + Send + Sync>;

/// One stream being dialled again.
pub type Dialling = std::pin::Pin<Box<dyn Future<Output = Result<Box<dyn Duplex>>> + Send>>;

/// The most resumes one transfer makes: a peer that keeps breaking its streams cannot
/// keep a transfer going for ever.
pub(crate) const MAX_RESUMES: u32 = 16;

/// The first wait between two dials of a stream; it doubles, up to `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Where a link's streams come back from.
enum Way {
    /// The side that dialled: it dials them.
    Redial(Redial),
    /// The listener's link: they come through its session's channel (the session's entry
    /// stays in the listener's table while the link lives).
    Await {
        joins: mpsc::Receiver<Joined>,
        /// Resumed streams that came and wait to be taken.
        arrived: Vec<Joined>,
        _entry: SessionEntry,
    },
}

/// How a link's streams come back after a failure.
pub struct Resume {
    /// How long they may take to.
    window: Duration,
    way: Way,
}

/// What resumes cost a link: counts for the caller (`Connection.resumed`), readable
/// while a transfer runs.
#[derive(Debug, Default)]
pub struct Resumed {
    /// Times every stream was replaced.
    pub times: AtomicU64,
    /// Chunks sent again after a resume: written before it, not held by the receiver.
    pub chunks_resent: AtomicU64,
}

impl Resumed {
    /// (times, chunks sent again).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.times.load(Ordering::Relaxed),
            self.chunks_resent.load(Ordering::Relaxed),
        )
    }
}

impl Resume {
    /// A dialler's: its streams dialled again with `redial`.
    pub fn redialling(window: Duration, redial: Redial) -> Self {
        Self {
            window,
            way: Way::Redial(redial),
        }
    }

    /// A listener's link's: its streams come through `joins` (`arrived`: resumed
    /// streams that came while it waited for its joins).
    pub(crate) fn awaiting(
        window: Duration,
        (joins, arrived): (mpsc::Receiver<Joined>, Vec<Joined>),
        entry: SessionEntry,
    ) -> Self {
        Self {
            window,
            way: Way::Await {
                joins,
                arrived,
                _entry: entry,
            },
        }
    }

    /// Ready once a resumed stream has come (a listener's link: the dialler saw a failure
    /// this side may not have); never for a dialler's.
    pub(super) fn poll_arrival(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Way::Await { joins, arrived, .. } = &mut self.way else {
            return Poll::Pending;
        };
        while let Poll::Ready(Some(joined)) = joins.poll_recv(cx) {
            if joined.resumed {
                arrived.push(joined);
            }
        }
        match arrived.is_empty() {
            true => Poll::Pending,
            false => Poll::Ready(()),
        }
    }

    /// `count` new streams, in index order, by `until`.
    async fn streams(&mut self, count: usize, until: Instant) -> Result<Vec<Box<dyn Duplex>>> {
        match &mut self.way {
            Way::Redial(redial) => {
                let mut dials = tokio::task::JoinSet::new();
                for index in 0..count {
                    let redial = redial.clone();
                    let index = u8::try_from(index).unwrap_or(u8::MAX);
                    dials.spawn(async move { (index, redial_one(&redial, index, until).await) });
                }
                let mut got: Vec<Option<Box<dyn Duplex>>> = (0..count).map(|_| None).collect();
                while let Some(done) = dials.join_next().await {
                    let (index, stream) =
                        done.map_err(|e| GradientStreamError::Io(std::io::Error::other(e)))?;
                    got[usize::from(index)] = Some(stream?);
                }
                Ok(got.into_iter().flatten().collect())
            }
            Way::Await { joins, arrived, .. } => {
                let mut got: Vec<Option<Box<dyn Duplex>>> = (0..count).map(|_| None).collect();
                // The newest stream of each index: a dialler that dialled one twice
                // dropped the first.
                let take = |joined: Joined, got: &mut Vec<Option<Box<dyn Duplex>>>| {
                    if let (true, Some(place)) =
                        (joined.resumed, got.get_mut(usize::from(joined.index)))
                    {
                        *place = Some(joined.stream);
                    }
                };
                for joined in arrived.drain(..) {
                    take(joined, &mut got);
                }
                while got.iter().any(Option::is_none) {
                    match tokio::time::timeout_at(until, joins.recv()).await {
                        Ok(Some(joined)) => take(joined, &mut got),
                        Ok(None) | Err(_) => {
                            let came = got.iter().filter(|s| s.is_some()).count();
                            return Err(out_of_window(format!(
                                "{came} of the connection's {count} streams came back"
                            )));
                        }
                    }
                }
                // Streams queued meanwhile are newer than those taken (a dial the dialler
                // gave up on and made again).
                while let Ok(joined) = joins.try_recv() {
                    take(joined, &mut got);
                }
                Ok(got.into_iter().flatten().collect())
            }
        }
    }
}

/// Dial stream `index` again until it is in, or `until`; an error that dialling again
/// cannot mend (the listener refused the proof, or has no such session) at once.
async fn redial_one(redial: &Redial, index: u8, until: Instant) -> Result<Box<dyn Duplex>> {
    let mut backoff = FIRST_BACKOFF;
    loop {
        let error = match tokio::time::timeout_at(until, redial(index)).await {
            Ok(Ok(stream)) => return Ok(stream),
            // Refused: nothing listens there any more (its process went); a restarted
            // listener would know no session either.
            Ok(Err(GradientStreamError::Io(io)))
                if io.kind() == std::io::ErrorKind::ConnectionRefused =>
            {
                return Err(GradientStreamError::Io(io))
            }
            Ok(Err(error @ (GradientStreamError::Io(_) | GradientStreamError::Timeout { .. }))) => {
                error
            }
            Ok(Err(error)) => return Err(error),
            Err(_) => {
                return Err(out_of_window(format!(
                    "stream {index} was not dialled again"
                )))
            }
        };
        if Instant::now() + backoff >= until {
            return Err(out_of_window(format!(
                "stream {index} was not dialled again (the last try: {error})"
            )));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Why a new stream (not the first) is of no use already: it ended, failed, or brought
/// bytes no one may send before the exchange (its peer writes nothing on it until the
/// states are exchanged on the first stream); None while it is quiet. Reads nothing
/// from a quiet stream.
fn ended_already(stream: &mut Counted) -> Option<String> {
    let mut probe = [0u8; 1];
    let mut buf = tokio::io::ReadBuf::new(&mut probe);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(stream).poll_read(&mut cx, &mut buf) {
        Poll::Pending => None,
        Poll::Ready(Ok(())) if buf.filled().is_empty() => Some("it ended".into()),
        Poll::Ready(Ok(())) => Some("it brought bytes before the exchange".into()),
        Poll::Ready(Err(e)) => Some(e.to_string()),
    }
}

/// What became of a transfer a sender mended (`Link::mend_send`).
pub(super) enum Mended {
    /// The peer acknowledged it (or said it took it): sent.
    Acknowledged,
    /// The streams are new; the receiver holds what its state says, of the transfer.
    Resumed(ResumeState),
}

/// How a round of a resume failed.
enum Round {
    /// The new streams failed before the states were exchanged: another round.
    Again(GradientStreamError),
    /// Nothing another round would mend.
    Final(GradientStreamError),
}

/// The error of a resume that did not happen within its window.
fn out_of_window(what: String) -> GradientStreamError {
    GradientStreamError::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("the connection did not resume within its resume window: {what}"),
    ))
}

impl Link {
    /// Whether the link's streams can come back after a failure.
    pub(super) fn resumable(&self) -> bool {
        self.resume.is_some()
    }

    /// Every stream replaced, then this side's state (`held`: the chunks it holds of
    /// the transfer it receives) told to the peer and the peer's read; within the
    /// resume window and the transfer's `clock` (`at`: where the transfer stands;
    /// `begun`: a byte of the transfer has moved). The peer's state.
    pub(super) async fn resume_streams(
        &mut self,
        held: Vec<(u32, u32)>,
        clock: &Clock,
        (at, begun): ((usize, Option<u32>), bool),
    ) -> Result<ResumeState> {
        // From here until the states are exchanged the peer and this side may disagree
        // on where the streams stand: a transfer dropped meanwhile leaves the link out of
        // step (`is_closed`), as does any failure.
        self.state = State::Running { moved: u64::MAX };
        let resumed = within(clock, at, async { Ok(self.resume_again(held).await) }).await;
        let theirs = resumed.and_then(|r| r)?;
        if !begun {
            // Mended before the transfer's first byte: the link is in step on its new
            // streams, as it was on the old (a receive given up now leaves it open).
            self.state = State::Running {
                moved: self.moved(),
            };
        }
        Ok(theirs)
    }

    /// `resume_now` until it works, or the window (from now) ends: a failure of the new
    /// streams before the states are exchanged (a path that fails again) is one more
    /// round, as many as `MAX_RESUMES`; a refusal, a dial that could not be made
    /// within the window, a message broken are final.
    async fn resume_again(&mut self, held: Vec<(u32, u32)>) -> Result<ResumeState> {
        let window = self.resume.as_ref().map_or(Duration::ZERO, |r| r.window);
        let until = Instant::now() + window;
        let mut rounds = 1;
        loop {
            match self.resume_now(&held, until).await {
                Ok(theirs) => return Ok(theirs),
                Err(Round::Again(_)) if rounds < MAX_RESUMES && Instant::now() < until => {
                    rounds += 1;
                }
                Err(Round::Again(error) | Round::Final(error)) => return Err(error),
            }
        }
    }

    async fn resume_now(
        &mut self,
        held: &[(u32, u32)],
        until: Instant,
    ) -> std::result::Result<ResumeState, Round> {
        let count = 1 + self.lanes.len();
        // The old streams stay open until the new ones are in (see the module's text).
        let _old = self.lend_streams();
        let Some(resume) = self.resume.as_mut() else {
            return Err(Round::Final(GradientStreamError::Io(
                std::io::Error::other("the connection does not resume"),
            )));
        };
        let mut new = resume
            .streams(count, until)
            .await
            .map_err(Round::Final)?
            .into_iter();
        if let Some(first) = new.next() {
            self.stream = Counted::of(first);
        }
        for (lane, stream) in self.lanes.iter_mut().zip(new) {
            *lane = Counted::of(stream);
        }
        self.lent = false;
        self.resumed.times.fetch_add(1, Ordering::Relaxed);
        // A stream the path failed again after its proof is another round now, before
        // the exchange waits on streams the peer may never take (it took that one).
        for (index, lane) in self.lanes.iter_mut().enumerate() {
            if let Some(why) = ended_already(lane) {
                let what = format!("stream {} failed again before the resume: {why}", index + 2);
                return Err(Round::Again(GradientStreamError::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    what,
                ))));
            }
        }
        let ours = self.resume_state(held.to_vec());
        let peer = self.peer.address.at();
        let exchanged = tokio::time::timeout_at(until, async {
            // A failure of the new streams here is a round to make again (the peer,
            // whose own exchange failed, drops them and waits for, or dials, new ones).
            let again = |e: std::io::Error| Round::Again(e.into());
            self.stream
                .write_all(&ours.to_bytes())
                .await
                .map_err(again)?;
            self.stream.flush().await.map_err(again)?;
            let ended = |got: usize, what: &str| {
                Round::Again(GradientStreamError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the resumed connection ended after {got} bytes of {what}"),
                )))
            };
            let mut start = [0u8; RESUME_LEN];
            if let Err(got) = read_full(&mut self.stream, &mut start)
                .await
                .map_err(again)?
            {
                return Err(ended(got, "a resume message"));
            }
            let (mut theirs, ranges) =
                ResumeState::parse_start(&start, peer.as_ref()).map_err(Round::Final)?;
            let mut bytes = vec![0u8; ranges as usize * 8];
            if let Err(got) = read_full(&mut self.stream, &mut bytes)
                .await
                .map_err(again)?
            {
                return Err(ended(got, "its ranges"));
            }
            theirs
                .parse_ranges(&bytes, peer.as_ref())
                .map_err(Round::Final)?;
            Ok(theirs)
        })
        .await;
        exchanged
            .unwrap_or_else(|_| Err(Round::Final(out_of_window("no resume message came".into()))))
    }

    /// The ack of the transfer just sent, on the first stream, within the transfer's
    /// clock (`at`: where it stands); or why none came (a failure, a wait out of time,
    /// the peer's resume, a message that is no ack), for `mend_send`.
    pub(super) async fn ack_or_break(
        &mut self,
        clock: &Clock,
        at: (usize, Option<u32>),
    ) -> Result<Ack> {
        let peer = self.peer.address.at();
        let (stream, resume) = (&mut self.stream, &mut self.resume);
        let waited = within(clock, at, async {
            Ok(tokio::select! {
                biased;
                () = Self::resume_arrival(resume) => None,
                ack = ack_on(stream, peer.as_ref()) => Some(ack),
            })
        });
        match waited.await? {
            Some(Ok(Ok(ack))) => Ok(ack),
            Some(Ok(Err(io))) => Err(io.into()),
            Some(Err(e)) => Err(e),
            None => Err(resumed_by_peer().into()),
        }
    }

    /// What a transfer's sender does once it `broke`: a failure no resume mends fails
    /// it; an ack (or a refusal) that came on the first stream settles it; else every
    /// stream is replaced (one more of the transfer's `resumes`), and the receiver's
    /// state says it took the transfer (its ack was lost: `digest` is what it must have
    /// taken, `complete` that every chunk was written) or what it holds of it. `total`:
    /// the transfer's chunks; `at`: where it stands. On an error the link is closed.
    pub(super) async fn mend_send(
        &mut self,
        broken: GradientStreamError,
        resumes: &mut u32,
        (digest, complete): ([u8; 32], bool),
        total: u32,
        clock: &Clock,
        at: (usize, Option<u32>),
    ) -> Result<Mended> {
        if !mendable(&broken) {
            let error = match broken {
                GradientStreamError::Io(io) => self.ack_failed(io),
                other => other,
            };
            return self.fail(error).await;
        }
        let peer = self.peer.address.at();
        // A receiver that refused the transfer wrote why on the first stream, then
        // closed its streams: that is no failure to resume from. And one that took it
        // may have acknowledged it there before another stream failed.
        let by_peer = matches!(&broken, GradientStreamError::Io(io) if ResumedByPeer::is(io));
        if !by_peer {
            let ack = tokio::time::timeout(LINGER, ack_on(&mut self.stream, peer.as_ref())).await;
            if let Ok(Ok(Ok(ack))) = ack {
                self.confirmed(ack, &digest, total).await?;
                return Ok(Mended::Acknowledged);
            }
        }
        *resumes += 1;
        if *resumes > MAX_RESUMES {
            let detail = format!(
                "the connection failed {resumes} times in one transfer (the last: {broken}); \
                 it resumes at most {MAX_RESUMES} times"
            );
            return self.fail(self.delivery(detail, None)).await;
        }
        let theirs = match self.resume_streams(Vec::new(), clock, (at, true)).await {
            Ok(theirs) => theirs,
            Err(e) => {
                let detail = format!(
                    "the connection failed before the peer acknowledged the transfer \
                     ({broken}) and did not resume: {e}"
                );
                return self.fail(self.delivery(detail, None)).await;
            }
        };
        let Mode::Sealed(keys) = &mut self.mode else {
            return Err(std::io::Error::other("a seed link does not resume").into());
        };
        let counter = keys.sent;
        if theirs.received == counter + 1 {
            // The receiver took the transfer; its ack went with the failed streams.
            if complete && theirs.last_digest == digest {
                keys.sent += 1;
                return Ok(Mended::Acknowledged);
            }
            let detail = format!(
                "after a resume, the peer says it took transfer {counter} with another digest \
                 than the frames this side sent"
            );
            return self.fail(self.delivery(detail, None)).await;
        }
        if theirs.received != counter {
            let error = GradientStreamError::Protocol {
                expected: format!(
                    "a resume message of a receiver that took {counter} or {} transfers",
                    counter + 1
                ),
                seen: format!("one that took {}", theirs.received),
                peer,
            };
            return self.fail(error).await;
        }
        Ok(Mended::Resumed(theirs))
    }

    /// This side's state as a receiver.
    fn resume_state(&self, held: Vec<(u32, u32)>) -> ResumeState {
        match &self.mode {
            Mode::Sealed(keys) => ResumeState {
                received: keys.received,
                last_digest: keys.last_digest,
                held,
            },
            Mode::Seed => ResumeState::default(),
        }
    }

    /// Ready once a resumed stream has come to a listener's link.
    pub(super) async fn resume_arrival(resume: &mut Option<Box<Resume>>) {
        poll_fn(|cx| match resume.as_mut() {
            Some(resume) => resume.poll_arrival(cx),
            None => Poll::Pending,
        })
        .await
    }
}

/// The failure a listener's link sees when its peer dialled the streams again.
pub(super) fn resumed_by_peer() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionReset, ResumedByPeer)
}

/// Why a listener's link resumes when its peer did first (no stream failed here).
#[derive(Debug)]
pub(super) struct ResumedByPeer;

impl ResumedByPeer {
    pub(super) fn is(error: &std::io::Error) -> bool {
        error.get_ref().is_some_and(|e| e.is::<Self>())
    }
}

impl std::fmt::Display for ResumedByPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the peer dialled the connection's streams again")
    }
}

impl std::error::Error for ResumedByPeer {}

/// The peer's next ack on `stream`; `Err` when the stream failed or ended first (an
/// `UnexpectedEof` when it ended).
pub(super) async fn ack_on(
    stream: &mut Counted,
    peer: Option<&PeerAt>,
) -> Result<std::io::Result<Ack>> {
    let ended = || {
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the first stream ended before the ack",
        )
    };
    let mut start = [0u8; START_LEN];
    match read_full(stream, &mut start).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return Ok(Err(ended())),
        Err(e) => return Ok(Err(e)),
    }
    let mut ack = vec![0u8; START_LEN + Ack::check_start(&start, peer)?];
    ack[..START_LEN].copy_from_slice(&start);
    match read_full(stream, &mut ack[START_LEN..]).await {
        Ok(Ok(())) => Ack::parse(&ack, peer).map(Ok),
        Ok(Err(_)) => Ok(Err(ended())),
        Err(e) => Ok(Err(e)),
    }
}

/// Whether a transfer's failure is one a resume mends: a stream reset or broken, or a
/// wait for bytes out of time. A stream the peer ended (a FIN: it closed the connection,
/// or its process went) is not: there is no one to resume with.
pub(super) fn mendable(error: &GradientStreamError) -> bool {
    match error {
        GradientStreamError::Io(io) => io.kind() != std::io::ErrorKind::UnexpectedEof,
        GradientStreamError::Timeout { .. } => true,
        _ => false,
    }
}
