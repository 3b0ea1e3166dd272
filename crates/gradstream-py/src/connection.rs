//! `gradstream._native.Link` and `Listener`, and `open_link` / `open_listener` that make
//! them: the core's connections (`gradstream_core::connection`) for
//! `gradstream/_connection.py`, with a session's `Engine` settings. Each async operation is
//! a job on the loop's `Completions`, as the socket transfers are; a link's operations
//! hold its lock for their whole run, so a second call while one runs is refused at once,
//! never queued.
//!
//! Uses `session` (the engine's settings and drivers), `convert`, `tensors`, `stream`
//! (progress), `fastpath` (what a small transfer is), `complete` and `errors`; used by
//! `lib.rs` alone.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use tokio::sync::Mutex as AsyncMutex;

use super::complete::{runtime, Completions, Outcome};
use super::convert::{GradientArgs, HeldGradient, Input, OutArgs};
use super::errors::{setting_error, to_py_err};
use super::fastpath;
use super::session::Engine;
use super::settings::{saturating_seconds, seconds_arg, ListenerArgs};
use super::stream::{progress_counters, TransferProgress};
use super::tensors::{HeldTensors, TensorArgs};
use gradstream_core::connection::link::Direct;
use gradstream_core::connection::{
    self, Bound as BoundAt, DialSettings, Event, Link, ListenSettings, Listener, LocalSettings,
    Peer, PeerAddress, Protocol, ReadBudget, Received, Refusal, Rings, Stopper,
};
use gradstream_core::error::{GradientStreamError, Result};
use gradstream_core::receiver::Ended;
use gradstream_core::stream::Waits;
use gradstream_core::tls::{TlsAcceptor, TlsConnector, TlsFiles};

/// `tls=` as the Python side hands it over: (cert, key, ca) paths, each optional.
#[derive(FromPyObject)]
pub struct TlsArgs(Option<PathBuf>, Option<PathBuf>, Option<PathBuf>);

impl From<TlsArgs> for TlsFiles {
    fn from(TlsArgs(cert, key, ca): TlsArgs) -> Self {
        TlsFiles { cert, key, ca }
    }
}

/// What a connection is made with, checked by the Python side: the protocol's name,
/// TLS files, the authkey, the handshake's bound, and the waits of its transfers.
#[derive(FromPyObject)]
pub struct LinkArgs {
    #[pyo3(item)]
    protocol: String,
    #[pyo3(item)]
    tls: Option<TlsArgs>,
    #[pyo3(item)]
    authkey: Option<Vec<u8>>,
    #[pyo3(item)]
    handshake_timeout: f64,
    #[pyo3(item)]
    timeout: Option<f64>,
    #[pyo3(item)]
    deadline: Option<f64>,
    /// A unix: connection's only acceptable peer user; None: any (always given, checked
    /// by `gradstream._connection`; unused over TCP).
    #[pyo3(item)]
    allowed_uid: Option<u32>,
    /// A client's streams (1 to 255, checked by `gradstream._checks`; 1 for a listener).
    #[pyo3(item, default)]
    streams: Option<u8>,
    /// A client's resume window in seconds (None: no resume; checked by
    /// `gradstream._checks`: an authkey or TLS, over TCP).
    #[pyo3(item, default)]
    resume: Option<f64>,
    /// Tests only, never set by `gradstream._connection`: this side's hello nonce, 32
    /// bytes (`DialSettings::test_nonce`), for the replays of recorded sessions.
    #[pyo3(item("_test_nonce"), default)]
    test_nonce: Option<Vec<u8>>,
}

impl LinkArgs {
    fn protocol(&self, py: Python<'_>) -> PyResult<Protocol> {
        match self.protocol.as_str() {
            "gradstream" => Ok(Protocol::Gradstream),
            "seed" => Ok(Protocol::Seed),
            other => Err(setting_error(
                py,
                "protocol",
                format!("protocol must be 'gradstream' or 'seed', not {other:?}"),
            )),
        }
    }

    fn test_nonce(&self, py: Python<'_>) -> PyResult<Option<[u8; 32]>> {
        self.test_nonce
            .as_deref()
            .map(|nonce| {
                <[u8; 32]>::try_from(nonce).map_err(|_| {
                    setting_error(py, "_test_nonce", "a test nonce is 32 bytes".into())
                })
            })
            .transpose()
    }

    /// A unix: connection's rule for its peer's user, and its rings.
    fn local(&self) -> LocalSettings {
        LocalSettings {
            allowed_uid: self.allowed_uid,
            rings: Rings::default(),
        }
    }

    fn waits(&self) -> Waits {
        let seconds = |s: Option<f64>| s.map(saturating_seconds);
        Waits {
            timeout: seconds(self.timeout),
            deadline: seconds(self.deadline),
        }
    }
}

/// `(host, port)` of an address.
fn address_tuple(address: SocketAddr) -> (String, u16) {
    (address.ip().to_string(), address.port())
}

/// How Python holds where a peer or a listener is: `(host, port)` over TCP, the string
/// `"unix:PATH"` on this host (gradstream._address).
#[derive(Clone, Debug, IntoPyObject)]
pub enum PyAddress {
    Tcp((String, u16)),
    Unix(String),
}

fn unix_text(path: &std::path::Path) -> String {
    format!("unix:{}", path.display())
}

impl From<&PeerAddress> for PyAddress {
    fn from(address: &PeerAddress) -> Self {
        match address {
            PeerAddress::Tcp(address) => Self::Tcp(address_tuple(*address)),
            PeerAddress::Local(peer) => Self::Unix(unix_text(&peer.path)),
        }
    }
}

impl From<&BoundAt> for PyAddress {
    fn from(address: &BoundAt) -> Self {
        match address {
            BoundAt::Tcp(address) => Self::Tcp(address_tuple(*address)),
            BoundAt::Unix(path) => Self::Unix(unix_text(path)),
        }
    }
}

/// A new Python `Link` for `link`, made on the loop's thread.
fn link_outcome(link: Link, engine: Py<Engine>, waits: Waits) -> Outcome {
    Outcome::Object(Box::new(move |py| {
        let link = PyLink::new(link, engine, waits);
        Ok(Py::new(py, link)?.into_any())
    }))
}

/// `open_link(engine, completions, host, port, args)`: connect to `host:port` with the
/// engine's settings (docs/guides/connections.md); a job whose result is a `Link`, after
/// the handshake.
#[pyfunction]
pub fn open_link(
    engine: &Bound<'_, Engine>,
    completions: &Bound<'_, Completions>,
    host: String,
    port: u16,
    args: LinkArgs,
) -> PyResult<u64> {
    let py = engine.py();
    let protocol = args.protocol(py)?;
    let test_nonce = args.test_nonce(py)?;
    let waits = args.waits();
    let local = args.local();
    let tls = match args.tls {
        Some(files) => Some(Arc::new(
            TlsConnector::new(&files.into()).map_err(|e| tls_setting_error(py, e))?,
        )),
        None => None,
    };
    let settings = DialSettings {
        protocol,
        tls,
        authkey: args.authkey,
        handshake_timeout: saturating_seconds(args.handshake_timeout),
        limits: engine.get().config().limits,
        streams: args.streams.unwrap_or(1),
        resume: args.resume.map(saturating_seconds),
        local,
        test_nonce,
    };
    let engine = engine.clone().unbind();
    Ok(completions.get().spawn(async move {
        let link = match host.strip_prefix("unix:") {
            // `gradstream._address`: a unix: address comes as its text, port 0.
            Some(path) if port == 0 => {
                connection::connect_unix(std::path::Path::new(path), &settings).await?
            }
            _ => connection::connect(&host, port, &settings).await?,
        };
        Ok(link_outcome(link, engine, waits))
    }))
}

/// `open_listener(engine, completions, host, port, args, listener)`: listen on
/// `host:port` with the engine's settings; a job whose result is a `Listener`.
/// `listener` holds the listener's own keywords (`ListenerArgs`).
#[pyfunction]
pub fn open_listener(
    engine: &Bound<'_, Engine>,
    completions: &Bound<'_, Completions>,
    host: String,
    port: u16,
    args: LinkArgs,
    listener: ListenerArgs,
) -> PyResult<u64> {
    let py = engine.py();
    let protocol = args.protocol(py)?;
    let test_nonce = args.test_nonce(py)?;
    let waits = args.waits();
    let local = args.local();
    let tls = match args.tls {
        Some(files) => Some(Arc::new(
            TlsAcceptor::new(&files.into()).map_err(|e| tls_setting_error(py, e))?,
        )),
        None => None,
    };
    let own = listener.parse();
    let settings = ListenSettings {
        protocol,
        tls,
        authkey: args.authkey,
        handshake_timeout: saturating_seconds(args.handshake_timeout),
        max_connections: own.max_connections,
        admission: own.admission,
        max_streams: own.max_streams,
        resume_window: own.resume_window,
        limits: engine.get().config().limits,
        local,
        test_nonce,
    };
    let engine = engine.clone().unbind();
    Ok(completions.get().spawn(async move {
        let listener = match host.strip_prefix("unix:") {
            // `gradstream._address`: a unix: address comes as its text, port 0.
            Some(path) if port == 0 => {
                Listener::bind_unix(std::path::Path::new(path), settings).await?
            }
            _ => Listener::bind(&host, port, settings).await?,
        };
        Ok(Outcome::Object(Box::new(move |py| {
            let address = PyAddress::from(listener.address());
            let stopper = Arc::new(listener.stopper());
            let listener = PyListener {
                listener: Arc::new(AsyncMutex::new(listener)),
                stopper,
                engine,
                waits,
                address,
            };
            Ok(Py::new(py, listener)?.into_any())
        })))
    }))
}

/// One connection, its peer, and the waits of its transfers.
#[pyclass(name = "Link", module = "gradstream._native", frozen)]
pub struct PyLink {
    link: Arc<AsyncMutex<Link>>,
    engine: Py<Engine>,
    waits: Waits,
    peer: Peer,
    streams: usize,
    /// Its streams are tokio's to drive, never the caller's thread: several streams (the
    /// striped engine's tasks), or a stream a resume may replace.
    tokio_driven: bool,
    /// The connection resumes (`connect(resume=)`, granted).
    resumes: bool,
    resumed: Arc<gradstream_core::connection::Resumed>,
}

impl PyLink {
    fn new(link: Link, engine: Py<Engine>, waits: Waits) -> Self {
        let peer = link.peer().clone();
        let streams = link.streams();
        let resumes = link.resumes();
        let tokio_driven = streams > 1 || resumes;
        let resumed = link.resumed();
        Self {
            link: Arc::new(AsyncMutex::new(link)),
            engine,
            waits,
            peer,
            streams,
            tokio_driven,
            resumes,
            resumed,
        }
    }

    /// The link, for one operation; refused while another runs.
    /// Through tokio (`Link::leave_direct`) unless the caller makes it direct again.
    fn take(&self, py: Python<'_>) -> PyResult<tokio::sync::OwnedMutexGuard<Link>> {
        let mut link = self.link.clone().try_lock_owned().map_err(|_| {
            setting_error(
                py,
                "connection",
                "another send or recv is running on this connection: one transfer at a time".into(),
            )
        })?;
        link.leave_direct();
        Ok(link)
    }

    /// Run `then` on the link now, on the caller's thread, within the runtime's context
    /// (its socket polled once, never waited for); nothing when an operation holds it.
    fn now<T>(&self, py: Python<'_>, then: impl FnOnce(&mut Link) -> T + Send) -> Option<T>
    where
        T: Send,
    {
        let mut link = self.link.try_lock().ok()?;
        Some(py.detach(|| {
            let _context = runtime().enter();
            then(&mut link)
        }))
    }

    /// This call's waits: the connection's timeout, and the call's deadline or else the
    /// connection's.
    fn waits(&self, deadline: Option<&Bound<'_, PyAny>>) -> PyResult<Waits> {
        Ok(Waits {
            timeout: self.waits.timeout,
            deadline: seconds_arg(deadline, "deadline")?.or(self.waits.deadline),
        })
    }
}

/// For a transfer its caller's thread drives itself (`Completions::run_here`, or
/// `drive`): the link's socket, its reads and writes made direct (`Link::go_direct`;
/// `park`: off tokio's reactor, for the blocking face, whose calls all stay direct);
/// None when not `wanted`, or the link has no socket to use so (TLS, or closed).
fn here_direct(link: &mut Link, wanted: bool, park: bool) -> Option<(std::os::fd::RawFd, Direct)> {
    if !wanted {
        return None;
    }
    link.go_direct(park)
}

/// A receive's result: the values or `out`'s owner; at the peer's close before a
/// gradient began, None when `none_at_end`, else what `receive_from` gives there (the
/// empty gradient, which must fit `out`).
fn received(got: Ended, owner: Option<Py<PyAny>>, none_at_end: bool) -> Result<Outcome> {
    let values = match got {
        Ended::BeforeFirstByte(_) if none_at_end => return Ok(Outcome::End),
        Ended::BeforeFirstByte(receiver) => receiver.finish()?,
        Ended::Gradient(values) => values,
    };
    Ok(match owner {
        Some(owner) => Outcome::Filled(owner),
        None => Outcome::Values(values),
    })
}

#[pymethods]
impl PyLink {
    /// `(address, tls_subject, authenticated, pid, uid)`: the address `(host, port)` or
    /// `"unix:PATH"`; pid and uid of a same-host peer (the kernel's), else None.
    fn peer(&self) -> (PyAddress, Option<String>, bool, Option<u32>, Option<u32>) {
        let (pid, uid) = match &self.peer.address {
            PeerAddress::Local(local) => (local.pid, Some(local.uid)),
            PeerAddress::Tcp(_) => (None, None),
        };
        (
            PyAddress::from(&self.peer.address),
            self.peer.tls_subject.clone(),
            self.peer.authenticated,
            pid,
            uid,
        )
    }

    /// How many streams the connection runs over (`connect(streams=)`, as granted).
    fn streams(&self) -> usize {
        self.streams
    }

    /// Whether the connection's streams are dialled again after a failure.
    fn resumes(&self) -> bool {
        self.resumes
    }

    /// (times every stream was replaced, chunks sent again after them).
    fn resumed(&self) -> (u64, u64) {
        self.resumed.counts()
    }

    /// Closed (by either side, or after a failure); False while an operation runs.
    fn closed(&self) -> bool {
        self.link.try_lock().is_ok_and(|link| link.is_closed())
    }

    /// Send one gradient: `(true, chunks)` when it was acknowledged before the call
    /// returned, else `(false, job)`, a job whose result is the chunk count, once
    /// acknowledged. A small gradient's frames are written from the caller's thread (no
    /// thread hop before its bytes move: docs/performance.md); the wait for the ack, and
    /// any larger send, run in tokio; or, with `here` (the blocking face), a small send
    /// on a plain TCP or same-host link runs to its end on the caller's thread (`run_here`); with
    /// `driven` (the asyncio face), it is polled there and, when it must wait, handed
    /// back as a `Driven` the loop polls again (`(false, Driven)`).
    #[pyo3(signature = (completions, gradient, progress, deadline, here=false, driven=false))]
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        py: Python<'_>,
        completions: &Bound<'_, Completions>,
        gradient: GradientArgs<'_>,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
        here: bool,
        driven: bool,
    ) -> PyResult<(bool, Py<PyAny>)> {
        let counters = progress_counters(progress);
        let waits = self.waits(deadline)?;
        let gradient = HeldGradient::new(&Input::try_from(gradient)?)?;
        let small = gradient.gradient().raw().len() <= fastpath::SEND_MAX;
        let config = self.engine.get().config().clone();
        // A striped link's streams have no shared read budget, a resumed one another
        // socket: tokio drives them.
        let caller_thread =
            small && !self.tokio_driven && self.engine.get().drivers().caller_thread;
        let mut link = self.take(py)?;
        let direct = here_direct(&mut link, (here || driven) && caller_thread, here);
        let transfer = async move {
            link.send_gradient(&config, gradient.gradient(), waits, &counters)
                .await
                .map(Outcome::Chunks)
        };
        match direct {
            Some((fd, direct)) if here => {
                return completions.get().run_here(py, transfer, fd, direct, None)
            }
            Some((fd, direct)) => return completions.get().drive(py, transfer, fd, direct),
            None => {}
        }
        if caller_thread {
            return completions.get().run_or_spawn(py, transfer, || ());
        }
        let job = completions.get().spawn(transfer);
        Ok((false, job.into_pyobject(py)?.into_any().unbind()))
    }

    /// Receive one gradient: `(true, result)` when it was all there when called (then
    /// received and acknowledged from the caller's thread, at most `fastpath::PEEK_MAX`
    /// bytes read there: the caller holds it as this call returns), else `(false, job)`,
    /// a job whose result is the values tuple or `out`'s array when given, its ack owed
    /// until the caller holds the result and calls `settle` (docs/guides/connections.md
    /// "Delivery"); when the peer closed before a gradient began, None if
    /// `none_at_end`, else as `receive_from` there. With `here` (the blocking face), on a
    /// plain TCP or same-host link, the receive runs on the caller's thread, waiting for the socket
    /// there (`run_here`), until it ends or has read `fastpath::PEEK_MAX` bytes (then
    /// tokio goes on with it, and the call waits for that): `(true, result)`, acknowledged.
    /// Not driven by an event loop's thread (as `send` is, with `driven`): a large
    /// gradient would stall while the loop is busy, where tokio goes on receiving it.
    #[pyo3(signature = (completions, progress, out, deadline, none_at_end, here=false))]
    #[allow(clippy::too_many_arguments)]
    fn recv(
        &self,
        py: Python<'_>,
        completions: &Bound<'_, Completions>,
        progress: Option<&Bound<'_, TransferProgress>>,
        out: Option<OutArgs<'_>>,
        deadline: Option<&Bound<'_, PyAny>>,
        none_at_end: bool,
        here: bool,
    ) -> PyResult<(bool, Py<PyAny>)> {
        let counters = progress_counters(progress);
        let waits = self.waits(deadline)?;
        let lent = out.as_ref().map(OutArgs::lend).transpose()?;
        let config = self.engine.get().config().clone();
        // A striped link's streams have no shared read budget, a resumed one another
        // socket: tokio drives them.
        let caller_thread = !self.tokio_driven && self.engine.get().drivers().caller_thread;
        let mut link = self.take(py)?;
        let direct = here_direct(&mut link, here && caller_thread, true);
        let budget = ReadBudget::new(fastpath::PEEK_MAX as u64);
        link.read_budget(Some(budget.clone()));
        let transfer = async move {
            let (receiver, owner) = match lent {
                Some(lent) => (config.receiver_into(lent.slice), Some(lent.owner)),
                None => (config.receiver(), None),
            };
            let got = link.recv_gradient(receiver, waits, &counters).await;
            link.read_budget(None);
            received(got?, owner, none_at_end)
        };
        if !caller_thread {
            budget.lift();
            let job = completions.get().spawn(transfer);
            return Ok((false, job.into_pyobject(py)?.into_any().unbind()));
        }
        let got = match direct {
            Some((fd, direct)) => {
                completions
                    .get()
                    .run_here(py, transfer, fd, direct, Some(budget))?
            }
            None => completions
                .get()
                .run_or_spawn(py, transfer, || budget.lift())?,
        };
        if got.0 {
            // A Ctrl-C that came while the receive ran: raised with the ack still owed
            // (the caller's `abandoned` refuses it), not after it was written.
            py.check_signals()?;
            self.settle(py);
        }
        Ok(got)
    }

    /// The caller holds the transfer the last receive gave: its ack is written now, from
    /// this thread, as far as the socket takes it at once (the rest by the next transfer
    /// or the close). Nothing when nothing is owed. Never fails: a failed write closes the
    /// connection, and the sender gets `DeliveryError` though this side has the transfer;
    /// on a connection that resumes it does not, and the resume (the next transfer's, or
    /// the sender's) tells the sender the transfer was taken.
    fn settle(&self, py: Python<'_>) {
        let Ok(mut link) = self.link.try_lock() else {
            return;
        };
        if link.owes() {
            py.detach(|| {
                let _context = runtime().enter();
                link.settle(true);
                link.send_settled_now();
            });
        }
    }

    /// After a transfer whose awaiting task was cancelled (its job stopped, its future
    /// gone): a transfer received but not taken is refused ("the receiver cancelled"),
    /// and a connection it left out of step is closed, its socket at once. True when the
    /// connection is closed.
    fn abandoned(&self, py: Python<'_>) -> bool {
        self.now(py, Link::abandoned).unwrap_or(false)
    }

    /// Close now, without waiting (a connection dropped without `close`): what is owed is
    /// refused, the socket closed. False when an operation holds the link.
    fn close_now(&self, py: Python<'_>) -> bool {
        self.now(py, Link::close_now).is_some()
    }

    /// Send a tensor set; a job whose result is the frame count, once acknowledged.
    #[pyo3(signature = (completions, tensors, progress, deadline))]
    fn send_tensors(
        &self,
        py: Python<'_>,
        completions: &Bound<'_, Completions>,
        tensors: Vec<TensorArgs<'_>>,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let counters = progress_counters(progress);
        let waits = self.waits(deadline)?;
        let held = HeldTensors::new(tensors)?;
        let engine = self.engine.get();
        let (config, wire) = (engine.config().clone(), engine.wire());
        let mut link = self.take(py)?;
        Ok(completions.get().spawn(async move {
            let gradients = held.gradients();
            link.send_tensors(&config, wire, &gradients, waits, &counters)
                .await
                .map(Outcome::Chunks)
        }))
    }

    /// Receive a tensor set of at most `max_values` values when given (checked by the
    /// caller); a job whose result is `[(name, values tuple), ...]`, or None when the
    /// peer closed before a set began.
    #[pyo3(signature = (completions, progress, deadline, max_values))]
    fn recv_tensors(
        &self,
        py: Python<'_>,
        completions: &Bound<'_, Completions>,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
        max_values: Option<usize>,
    ) -> PyResult<u64> {
        let counters = progress_counters(progress);
        let waits = self.waits(deadline)?;
        let config = self.engine.get().config().clone();
        let mut link = self.take(py)?;
        Ok(completions.get().spawn(async move {
            Ok(
                match link
                    .recv_tensors(&config, max_values, waits, &counters)
                    .await?
                {
                    Received::Transfer(set) => Outcome::Tensors(set),
                    Received::End => Outcome::End,
                },
            )
        }))
    }

    /// Close the connection: `(true, None)` when done from the caller's thread (the
    /// usual case: the socket is closed as the call returns), else `(false, job)`, a job
    /// whose result is None. Waits for a running transfer's end (the Python side cancels
    /// it first).
    fn close(
        &self,
        py: Python<'_>,
        completions: &Bound<'_, Completions>,
    ) -> PyResult<(bool, Py<PyAny>)> {
        match self.link.clone().try_lock_owned() {
            Ok(mut link) => {
                link.leave_direct();
                completions.get().run_or_spawn(
                    py,
                    async move {
                        link.close().await;
                        Ok(Outcome::End)
                    },
                    || (),
                )
            }
            Err(_) => {
                let link = self.link.clone();
                let job = completions.get().spawn(async move {
                    let mut link = link.lock().await;
                    link.leave_direct();
                    link.close().await;
                    Ok(Outcome::End)
                });
                Ok((false, job.into_pyobject(py)?.into_any().unbind()))
            }
        }
    }
}

/// A bound listener.
#[pyclass(name = "Listener", module = "gradstream._native", frozen)]
pub struct PyListener {
    listener: Arc<AsyncMutex<Listener>>,
    /// Stops the accept loop without waiting for the lock a pending `next` holds.
    stopper: Arc<Stopper>,
    engine: Py<Engine>,
    waits: Waits,
    address: PyAddress,
}

#[pymethods]
impl PyListener {
    /// The address bound: `(host, port)`, or `"unix:PATH"`.
    #[getter]
    fn address(&self) -> PyAddress {
        self.address.clone()
    }

    /// The next event; a job whose result is `("connection", Link)`,
    /// `("refused", (host, port), exception)`, `("silent", ...)`, `("dropped", ...)` (see
    /// `refused`), or None once closed.
    fn next(&self, py: Python<'_>, completions: &Bound<'_, Completions>) -> u64 {
        let listener = self.listener.clone();
        let engine = self.engine.clone_ref(py);
        let waits = self.waits;
        completions.get().spawn(async move {
            let event = listener.lock().await.next().await;
            Ok(match event {
                None => Outcome::End,
                Some(Event::Connected(link)) => Outcome::Object(Box::new(move |py| {
                    let link = Py::new(py, PyLink::new(link, engine, waits))?;
                    Ok(("connection", link).into_pyobject(py)?.into_any().unbind())
                })),
                Some(Event::Refused { address, why }) => {
                    Outcome::Object(Box::new(move |py| refused(py, address, why)))
                }
            })
        })
    }

    /// Stop accepting; a job (its result None) done once the listening socket is closed
    /// (handshakes under way are dropped; accepted links live on).
    fn close(&self, completions: &Bound<'_, Completions>) -> u64 {
        let stopper = self.stopper.clone();
        completions.get().spawn(async move {
            stopper.stop().await;
            Ok(Outcome::End)
        })
    }
}

/// `("refused", (host, port), exception)`, `("silent", (host, port), seconds)` for a
/// peer that did not finish its handshake within that long, or `("dropped", (host, port),
/// why)` for a peer the listener closed itself (a cap, a silence, a source locked out).
fn refused(py: Python<'_>, address: PeerAddress, why: Refusal) -> PyResult<Py<PyAny>> {
    let address = PyAddress::from(&address);
    let event = match why {
        Refusal::Failed(error) => {
            let exception = to_py_err(py, error).into_value(py);
            ("refused", address, exception.into_any()).into_pyobject(py)?
        }
        Refusal::Silent(limit) => {
            let seconds = limit.as_secs_f64().into_pyobject(py)?.into_any();
            ("silent", address, seconds).into_pyobject(py)?
        }
        Refusal::Shed(why) => {
            let why = why.to_string().into_pyobject(py)?.into_any();
            ("dropped", address, why).into_pyobject(py)?
        }
    };
    Ok(event.into_any().unbind())
}

/// A TLS side's files that do not load: a `SettingError` (setting `tls`), made before any
/// peer is met.
fn tls_setting_error(py: Python<'_>, error: GradientStreamError) -> PyErr {
    match error {
        GradientStreamError::Tls { detail, .. } => setting_error(py, "tls", detail),
        other => to_py_err(py, other),
    }
}
