//! Delivering tokio results to asyncio without a tokio thread ever touching Python.
//!
//! pyo3-async-runtimes' `future_into_py` resolves the asyncio future from a tokio thread
//! (`call_soon_threadsafe`, which drops and retakes the GIL). When the interpreter starts
//! finalizing in that window, CPython ends the thread with `pthread_exit`, unwinding
//! through Rust frames, and the process aborts: it did, in about a third of short CLI runs
//! (upstream: PyO3/pyo3-async-runtimes#40). Here a finished transfer only queues its
//! result and writes to an eventfd; the event loop watches the eventfd (`add_reader`) and
//! turns queued results into Python objects on its own thread (`gradstream._aio.Hub`, which owns one `Completions` per loop and hands
//! it to every native transfer it starts).
//! The tasks run on the extension's tokio runtime (`runtime`), made on first use and made
//! again in a process forked from one that had made it.
//!
//! Uses `convert` and `tensors` (results to Python values) and `errors`; used by `session`,
//! `connection` and `fastpath`.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::convert::values_tuple;
use super::errors::to_py_err;
use super::tensors::set_list;
use gradstream_core::connection::link::Direct;
use gradstream_core::connection::ReadBudget;
use gradstream_core::error::GradientStreamError;
use gradstream_core::output::Output;

/// A runtime and the process that made it.
struct Made {
    pid: u32,
    runtime: Runtime,
}

/// The current `Made`, leaked (never freed): null until the first transfer.
static RUNTIME: AtomicPtr<Made> = AtomicPtr::new(std::ptr::null_mut());

/// The tokio runtime of this process's transfers, made on first use. A child forked from a
/// process that had made one gets one of its own on first use: it has none of the
/// parent's worker threads (fork copies only the thread that called it), so the parent's
/// runtime would never run a task there (a transfer would wait for ever). The parent's is
/// left as it is, never dropped: dropping it would wait for those threads.
pub(crate) fn runtime() -> &'static Runtime {
    let pid = std::process::id();
    let found = RUNTIME.load(Ordering::Acquire);
    // SAFETY: `RUNTIME` is null or a pointer from `Box::into_raw` below, never freed.
    if let Some(made) = unsafe { found.as_ref() } {
        if made.pid == pid {
            return &made.runtime;
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("gradstream-tokio")
        .build()
        // Only when the system refuses the runtime's threads or its epoll descriptor: no
        // transfer could run (a Python exception, PanicException, with this text).
        .expect("gradstream: cannot start the tokio runtime of its transfers");
    let fresh = Box::into_raw(Box::new(Made { pid, runtime }));
    match RUNTIME.compare_exchange(found, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `fresh` is now `RUNTIME`'s, never freed.
        Ok(_) => unsafe { &(*fresh).runtime },
        Err(now) => {
            // Another thread of this process made one first: ours never ran a task.
            // SAFETY: `fresh` came from `Box::into_raw` above and nobody else saw it.
            let ours = unsafe { Box::from_raw(fresh) };
            ours.runtime.shutdown_background();
            // SAFETY: `now` differs from `found`, so it is a pointer this function stored
            // (`RUNTIME` only ever changes to one), never freed.
            unsafe { &(*now).runtime }
        }
    }
}

/// What a finished transfer hands back.
pub enum Outcome {
    Chunks(usize),
    /// The values, in the shape the sender kept.
    Values(Output),
    /// The gradient is in the caller's `out=` array, handed back.
    Filled(Py<PyAny>),
    /// The stream ended before the gradient's first byte.
    End,
    /// A tensor set, in the sender's order.
    Tensors(gradstream_core::tensors::TensorSet),
    /// A Python object to make on the loop's thread (a new connection or listener).
    Object(MakeObject),
}

/// Makes a result's Python object, with the GIL, on the loop's thread.
pub type MakeObject = Box<dyn FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send>;

type Finished = (u64, Result<Outcome, GradientStreamError>);

struct Shared {
    eventfd: OwnedFd,
    finished: Mutex<Vec<Finished>>,
    running: Mutex<HashMap<u64, JoinHandle<()>>>,
    /// Wakes a thread blocked in `Completions.wait` (the blocking face, `gradstream.sync`).
    arrived: Condvar,
    /// The stop flag of the transfer a thread drives itself (`run_here`), if one runs:
    /// `abort_all` sets it.
    here: Mutex<Option<Arc<AtomicBool>>>,
    /// The `Driven` transfers woken since the last `drain`.
    woken: Mutex<Vec<u64>>,
}

/// A transfer driven by its caller's thread (`run_here`) is woken (a timer, a lock) by a
/// write to the eventfd it waits on beside its socket.
impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.signal();
    }
}

impl Shared {
    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self, job: u64, result: Result<Outcome, GradientStreamError>) {
        Self::lock(&self.running).remove(&job);
        Self::lock(&self.finished).push((job, result));
        self.arrived.notify_all();
        self.signal();
    }

    /// Make the eventfd readable.
    fn signal(&self) {
        let one = 1u64;
        // SAFETY: writing 8 bytes to our eventfd. It cannot fail short; a full counter
        // (EAGAIN, after 2^64 writes) would still leave the fd readable.
        unsafe { libc::write(self.eventfd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Make the eventfd unreadable (its counter back to zero).
    fn unsignal(&self) {
        let mut counter = 0u64;
        // SAFETY: reading 8 bytes from our non-blocking eventfd resets it (EAGAIN if zero).
        unsafe {
            libc::read(
                self.eventfd.as_raw_fd(),
                (&mut counter as *mut u64).cast(),
                8,
            )
        };
    }
}

/// How a stretch of `run_here`'s driving (GIL released) ended.
enum Step {
    Done(Result<Outcome, GradientStreamError>),
    /// `abort_all` stopped it.
    Stopped,
    /// Its read budget ran out: tokio takes it over.
    Escape,
    /// A wait slice ended (or a signal came): the signal handlers run, then it goes on.
    Slice,
}

type Transfer = Pin<Box<dyn Future<Output = Result<Outcome, GradientStreamError>> + Send>>;

/// The Rust half of one event loop's hub: runs transfers, queues their results.
#[pyclass(module = "gradstream._native", name = "Completions", frozen)]
pub struct Completions {
    shared: Arc<Shared>,
}

static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

/// A transfer's result as Python sees it: (true, the value) or (false, the exception).
fn to_python(
    py: Python<'_>,
    result: Result<Outcome, GradientStreamError>,
) -> PyResult<(bool, Py<PyAny>)> {
    Ok(match result {
        Ok(Outcome::Chunks(n)) => (true, n.into_pyobject(py)?.into_any().unbind()),
        Ok(Outcome::Values(values)) => (true, values_tuple(py, values)?.unbind()),
        Ok(Outcome::Filled(out)) => (true, out),
        Ok(Outcome::End) => (true, py.None()),
        Ok(Outcome::Tensors(set)) => (true, set_list(py, set)?.into_any().unbind()),
        Ok(Outcome::Object(make)) => match make(py) {
            Ok(object) => (true, object),
            Err(e) => (false, e.into_value(py).into_any()),
        },
        Err(e) => (false, to_py_err(py, e).into_value(py).into_any()),
    })
}

/// `to_python`'s pair as a result: the value, or the exception raised.
fn raised(py: Python<'_>, (ok, value): (bool, Py<PyAny>)) -> PyResult<Py<PyAny>> {
    if ok {
        Ok(value)
    } else {
        Err(PyErr::from_value(value.into_bound(py)))
    }
}

impl Completions {
    /// Run `transfer` on the caller's thread (GIL released, in the runtime's context) up
    /// to its first wait: `(true, result)` when it finished there, its exception raised
    /// when it failed there, else `(false, job)`: it goes on in tokio from where it
    /// stopped, once `unbound` has run. Only for transfers whose first steps are bounded
    /// (a small send; a receive under a read budget that `unbound` lifts): the caller's
    /// event loop waits meanwhile.
    pub fn run_or_spawn<F>(
        &self,
        py: Python<'_>,
        transfer: F,
        unbound: impl FnOnce(),
    ) -> PyResult<(bool, Py<PyAny>)>
    where
        F: Future<Output = Result<Outcome, GradientStreamError>> + Send + 'static,
    {
        let runtime = runtime();
        let mut transfer = Box::pin(transfer);
        let polled = py.detach(|| {
            let _context = runtime.enter();
            let mut cx = Context::from_waker(Waker::noop());
            transfer.as_mut().poll(&mut cx)
        });
        match polled {
            Poll::Ready(result) => Ok((true, raised(py, to_python(py, result)?)?)),
            // The tokio task polls it again at once, with its own waker.
            Poll::Pending => {
                unbound();
                let job = self.spawn(transfer);
                Ok((false, job.into_pyobject(py)?.into_any().unbind()))
            }
        }
    }

    /// Run `transfer` to its end on the caller's thread (the blocking face), its link in
    /// `direct` mode on socket `fd`: polled, then, while it waits, the thread waits in
    /// poll(2) for the socket (what the transfer's last step would block on) and for
    /// this `Completions`' eventfd (its waker: tokio timers, `abort_all`), in slices of
    /// `WAIT_SLICE` with the signal handlers run between them (GIL released but for
    /// those). No thread hop: the kernel wakes this thread, which moves the bytes. When
    /// `budget` runs out (a large receive), the transfer goes on in tokio from where it
    /// stopped and is waited for as `wait` does. `(true, result)`, or its exception
    /// raised; `(true, None)` when `abort_all` stopped it (its future dropped). A
    /// handler's exception (Ctrl-C) is raised once the transfer's future is dropped.
    pub fn run_here<F>(
        &self,
        py: Python<'_>,
        transfer: F,
        fd: RawFd,
        direct: Direct,
        budget: Option<ReadBudget>,
    ) -> PyResult<(bool, Py<PyAny>)>
    where
        F: Future<Output = Result<Outcome, GradientStreamError>> + Send + 'static,
    {
        let runtime = runtime();
        let mut transfer: Transfer = Box::pin(transfer);
        let stop = Arc::new(AtomicBool::new(false));
        *Shared::lock(&self.shared.here) = Some(stop.clone());
        let waker = Waker::from(self.shared.clone());
        let ended = loop {
            let step = py.detach(|| {
                let _context = runtime.enter();
                self.drive_here(&mut transfer, &waker, fd, &direct, budget.as_ref(), &stop)
            });
            match step {
                Step::Slice => match py.check_signals() {
                    Ok(()) => continue,
                    Err(e) => break Err(e),
                },
                other => break Ok(other),
            }
        };
        if !matches!(ended, Ok(Step::Escape)) {
            *Shared::lock(&self.shared.here) = None;
        }
        // The link stays direct for the caller's next call (its ack, its next transfer):
        // any call that hands the link to tokio leaves direct mode first.
        match ended {
            Ok(Step::Done(result)) => Ok((true, raised(py, to_python(py, result)?)?)),
            Ok(Step::Escape) => {
                direct.off();
                if let Some(budget) = budget {
                    budget.lift();
                }
                // `here` is cleared only once the job is in the running table, so an
                // `abort_all` in between reaches one or the other, never neither.
                let job = self.spawn(transfer);
                *Shared::lock(&self.shared.here) = None;
                if stop.load(Ordering::Acquire) {
                    let _ = self.abort(job);
                }
                Ok((true, raised(py, self.wait(py, job)?)?))
            }
            Ok(_) => {
                py.detach(|| drop(transfer));
                Ok((true, py.None()))
            }
            Err(e) => {
                // Dropped before the exception goes on: the link is free for its
                // post-cancel rule (`abandoned`).
                py.detach(|| drop(transfer));
                Err(e)
            }
        }
    }

    /// `run_here`'s driving until the transfer ends or a wait slice does.
    fn drive_here(
        &self,
        transfer: &mut Transfer,
        waker: &Waker,
        fd: RawFd,
        direct: &Direct,
        budget: Option<&ReadBudget>,
        stop: &AtomicBool,
    ) -> Step {
        let mut cx = Context::from_waker(waker);
        self.shared.unsignal();
        let slice_end = std::time::Instant::now() + WAIT_SLICE;
        loop {
            if let Poll::Ready(result) = transfer.as_mut().poll(&mut cx) {
                return Step::Done(result);
            }
            if stop.load(Ordering::Acquire) {
                return Step::Stopped;
            }
            if budget.is_some_and(ReadBudget::exhausted) {
                return Step::Escape;
            }
            let (read, write) = direct.take_wants();
            let events =
                if read { libc::POLLIN } else { 0 } | if write { libc::POLLOUT } else { 0 };
            let mut fds = [
                libc::pollfd {
                    // A negative descriptor is skipped: waiting for a timer or a lock, not
                    // the socket (whose hang-up poll would report regardless).
                    fd: if events == 0 { -1 } else { fd },
                    events,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.shared.eventfd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let left = slice_end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Step::Slice;
            }
            let slice = left.as_millis().max(1) as libc::c_int;
            // SAFETY: `fds` is a live array of two pollfd, which poll(2) only reads and
            // writes `revents` of. The eventfd is open (held by `self`); the socket's
            // number may be stale if the transfer closed its socket in the poll above,
            // which costs a POLLNVAL or a spurious wake, never memory: the wants are
            // read again before the next poll.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, slice) };
            if ready < 0
                && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                // poll failed (ENOMEM, ...): the rest of the slice is waited out rather
                // than spun, then the handlers run and the transfer is polled again.
                std::thread::sleep(left);
                return Step::Slice;
            }
            if ready <= 0 {
                // The slice ended, or a signal came (EINTR): the handlers run.
                return Step::Slice;
            }
            if fds[1].revents != 0 {
                self.shared.unsignal();
            }
        }
    }

    /// Start `transfer` on the tokio runtime; its job number.
    pub fn spawn<F>(&self, transfer: F) -> u64
    where
        F: Future<Output = Result<Outcome, GradientStreamError>> + Send + 'static,
    {
        let job = NEXT_JOB.fetch_add(1, Ordering::Relaxed);
        let shared = self.shared.clone();
        let runtime = runtime();
        // Hold the table while spawning so the task cannot finish (and remove itself)
        // before its abort handle is in.
        let mut running = Shared::lock(&self.shared.running);
        let handle = runtime.spawn(async move {
            let result = transfer.await;
            shared.finish(job, result);
        });
        running.insert(job, handle);
        job
    }

    /// Poll `transfer` once on the caller's thread (an event loop's: the asyncio face),
    /// its link in `direct` mode on socket `fd`: `(true, result)` when it finished
    /// there (its exception raised when it failed), else `(false, Driven)`, which the
    /// loop polls again once `fd` is ready or the transfer is woken (`Driven`). Only for
    /// transfers whose reads are bounded (a small send's ack): nothing of it moves
    /// while the loop is busy.
    pub fn drive<F>(
        &self,
        py: Python<'_>,
        transfer: F,
        fd: RawFd,
        direct: Direct,
    ) -> PyResult<(bool, Py<PyAny>)>
    where
        F: Future<Output = Result<Outcome, GradientStreamError>> + Send + 'static,
    {
        let job = NEXT_JOB.fetch_add(1, Ordering::Relaxed);
        let driven = Driven {
            transfer: Mutex::new(Some(Box::pin(transfer))),
            waker: Waker::from(Arc::new(Woken {
                shared: self.shared.clone(),
                job,
            })),
            job,
            fd,
            direct,
        };
        let (step, value) = driven.poll(py)?;
        if step == DRIVEN_DONE {
            return Ok((true, value.unbind()));
        }
        if value.is_truthy()? {
            // Frames left to write: tokio writes them while the loop is busy.
            driven.direct.off();
            let transfer = Shared::lock(&driven.transfer).take();
            if let Some(transfer) = transfer {
                let job = self.spawn(transfer);
                return Ok((false, job.into_pyobject(py)?.into_any().unbind()));
            }
        }
        Ok((false, Py::new(py, driven)?.into_any()))
    }
}

/// What `Driven.poll` says: the result is here, or wait (for the socket or a wake-up).
const DRIVEN_DONE: u8 = 0;
const DRIVEN_WAIT: u8 = 1;

/// A `Driven` transfer's waker (tokio timers, a lock): queues its job as woken and makes
/// the eventfd readable; the hub (`drain`) hands the loop `(job, true, None)`.
struct Woken {
    shared: Arc<Shared>,
    job: u64,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        Shared::lock(&self.shared.woken).push(self.job);
        self.shared.signal();
    }
}

/// A transfer an event loop's thread drives itself (the asyncio face's equivalent of
/// `run_here`): its link's socket is read and written directly (`Direct`); while it
/// waits, the loop watches the socket (`gradstream._aio.drive`: readable in the hub's
/// `Readiness`, writable with `add_writer`) and the hub's eventfd for its wake-ups (its
/// `job` comes out of `drain`), then polls it again. One wake-up per message, the loop's
/// own, instead of a tokio worker's and then the loop's. Dropped (`stop`, or the
/// object), the transfer's future is dropped at once, on this thread.
#[pyclass(module = "gradstream._native", name = "Driven", frozen)]
pub struct Driven {
    transfer: Mutex<Option<Transfer>>,
    waker: Waker,
    job: u64,
    fd: RawFd,
    direct: Direct,
}

impl Driven {
    fn poll<'py>(&self, py: Python<'py>) -> PyResult<(u8, Bound<'py, PyAny>)> {
        let mut slot = Shared::lock(&self.transfer);
        let Some(transfer) = slot.as_mut() else {
            let error = std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the transfer was stopped or has ended",
            );
            return Err(to_py_err(py, GradientStreamError::Io(error)));
        };
        let polled = py.detach(|| {
            let _context = runtime().enter();
            self.direct.take_wants();
            let mut cx = Context::from_waker(&self.waker);
            transfer.as_mut().poll(&mut cx)
        });
        match polled {
            Poll::Ready(result) => {
                *slot = None;
                self.direct.off();
                let value = raised(py, to_python(py, result)?)?;
                Ok((DRIVEN_DONE, value.into_bound(py)))
            }
            Poll::Pending => {
                let (_, write) = self.direct.take_wants();
                let write = pyo3::types::PyBool::new(py, write).to_owned().into_any();
                Ok((DRIVEN_WAIT, write))
            }
        }
    }
}

#[pymethods]
impl Driven {
    /// The socket to wait for.
    #[getter]
    fn fd(&self) -> RawFd {
        self.fd
    }

    /// The job number its wake-ups come out of `Completions.drain` with.
    #[getter]
    fn job(&self) -> u64 {
        self.job
    }

    /// One try: `(0, result)` when done, `(1, write)` to wait for the socket (writable
    /// when `write`, else readable) or a wake-up and poll again. Raises what the
    /// transfer raises.
    #[pyo3(name = "poll")]
    fn poll_py<'py>(&self, py: Python<'py>) -> PyResult<(u8, Bound<'py, PyAny>)> {
        self.poll(py)
    }

    /// Drop the transfer now (its awaiting task was cancelled), after one last poll:
    /// what its socket holds already may end it (an ack that arrived while the loop was
    /// busy, which tokio would have read meanwhile), its result dropped. Nothing of it
    /// runs after this returns.
    fn stop(&self, py: Python<'_>) {
        let transfer = Shared::lock(&self.transfer).take();
        py.detach(|| {
            if let Some(mut transfer) = transfer {
                let _context = runtime().enter();
                let mut cx = Context::from_waker(Waker::noop());
                let _ = transfer.as_mut().poll(&mut cx);
            }
        });
        self.direct.off();
    }
}

/// How long a blocking wait holds without running the signal handlers (Ctrl-C).
const WAIT_SLICE: Duration = Duration::from_millis(50);

#[pymethods]
impl Completions {
    #[new]
    fn new() -> PyResult<Self> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(Self {
            shared: Arc::new(Shared {
                // SAFETY: `fd` is a fresh descriptor we own.
                eventfd: unsafe { OwnedFd::from_raw_fd(fd) },
                finished: Mutex::default(),
                running: Mutex::default(),
                arrived: Condvar::new(),
                here: Mutex::default(),
                woken: Mutex::default(),
            }),
        })
    }

    fn fileno(&self) -> i32 {
        self.shared.eventfd.as_raw_fd()
    }

    /// The finished jobs as (job, ok, result or exception), converted on the caller's
    /// thread; then the `Driven` transfers woken, each as (job, true, None).
    fn drain(&self, py: Python<'_>) -> PyResult<Vec<(u64, bool, Py<PyAny>)>> {
        self.shared.unsignal();
        let finished = std::mem::take(&mut *Shared::lock(&self.shared.finished));
        let woken = std::mem::take(&mut *Shared::lock(&self.shared.woken));
        finished
            .into_iter()
            .map(|(job, result)| {
                let (ok, value) = to_python(py, result)?;
                Ok((job, ok, value))
            })
            .chain(woken.into_iter().map(|job| Ok((job, true, py.None()))))
            .collect()
    }

    /// Stop a job (its awaiting task was cancelled): true when it had already finished
    /// (its future is gone: nothing of it runs any more), else false, and its future is
    /// dropped at its next step on tokio, after which the job finishes with None (queued
    /// as any result: the loop's hub resolves the wait of `_aio.Hub.stop` with it). Never
    /// waits: the event loop is not blocked while a step that writes into a caller's
    /// `out=` array ends (docs/guides/connections.md "Delivery").
    fn abort(&self, job: u64) -> bool {
        let Some(handle) = Shared::lock(&self.shared.running).remove(&job) else {
            return true;
        };
        if handle.is_finished() {
            return true;
        }
        handle.abort();
        let shared = self.shared.clone();
        // The handle resolves once the task's future is dropped (or has finished).
        runtime().spawn(async move {
            let _ = handle.await;
            shared.finish(job, Ok(Outcome::End));
        });
        false
    }

    /// Block until `job` ends (the blocking face, `gradstream.sync`: one `Completions` per
    /// thread, one job at a time), the GIL released, in slices of `WAIT_SLICE` with the
    /// signal handlers run between them: `(true, result)` or `(false, exception)`. A
    /// handler's exception (Ctrl-C's KeyboardInterrupt) is raised with the job still
    /// running: the caller stops it with `stop_all`, then applies the connection's
    /// post-cancel rule.
    fn wait(&self, py: Python<'_>, job: u64) -> PyResult<(bool, Py<PyAny>)> {
        loop {
            let found = py.detach(|| {
                let mut finished = Shared::lock(&self.shared.finished);
                let at = finished.iter().position(|(done, _)| *done == job);
                if at.is_none() {
                    finished = self
                        .shared
                        .arrived
                        .wait_timeout(finished, WAIT_SLICE)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                let at = finished.iter().position(|(done, _)| *done == job)?;
                Some(finished.swap_remove(at).1)
            });
            if let Some(result) = found {
                return to_python(py, result);
            }
            py.check_signals()?;
        }
    }

    /// Stop every job of this `Completions` and block (GIL released) until each one's
    /// future is gone on tokio: nothing of them writes into a caller's `out=` afterwards
    /// (docs/guides/connections.md "Delivery"). Their results, if they finished
    /// meanwhile, are dropped (the caller's `abandoned` rule refuses a transfer received
    /// and not taken). For the blocking face, whose call was interrupted (Ctrl-C) with
    /// its job still running, perhaps before it was handed the job's number.
    fn stop_all(&self, py: Python<'_>) {
        let handles: Vec<(u64, JoinHandle<()>)> =
            Shared::lock(&self.shared.running).drain().collect();
        py.detach(|| {
            for (_, handle) in handles {
                handle.abort();
                // The handle resolves once the task's future is dropped (or finished).
                let _ = runtime().block_on(handle);
            }
        });
        Shared::lock(&self.shared.finished).clear();
    }

    /// Stop every job of this `Completions` without waiting, as `abort` does each: a
    /// thread blocked in `wait` for one gets `(true, None)` once its future is gone on
    /// tokio; one driving a transfer itself (`run_here`), once it dropped its future.
    /// For `gradstream.sync.Server.shutdown`, from another thread than the handler's
    /// that waits (the handler's connection says why it ended).
    fn abort_all(&self) {
        if let Some(stop) = Shared::lock(&self.shared.here).as_ref() {
            stop.store(true, Ordering::Release);
            self.shared.signal();
        }
        let jobs: Vec<u64> = Shared::lock(&self.shared.running).keys().copied().collect();
        for job in jobs {
            // True when it had finished already: its result is queued, the waiter's.
            let _ = self.abort(job);
        }
    }

    /// Jobs still running.
    fn __len__(&self) -> usize {
        Shared::lock(&self.shared.running).len()
    }
}
