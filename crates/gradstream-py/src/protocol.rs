//! The connection protocol's messages (`gradstream_core::protocol`, docs/spec/protocol.md),
//! sans-I/O, as functions for the golden tests (tests/support/protocol.py holds the two
//! implementations to the same bytes and the same refusals): they convert bytes and ints,
//! nothing more.
//!
//! Uses `errors`; used by `lib` (the module's functions).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::IntoPyResult;
use gradstream_core::connection::digest_of_stream;
use gradstream_core::frame::HEADER_LEN;
use gradstream_core::protocol::{
    auth_message, describe, parse_auth, parse_pake, transfer_id, Ack, Digest, Direction, Exchange,
    Hello, Role, ScalarSeed, AUTH_LEN, HELLO_LEN, PAKE_LEN, SEED_LEN, START_LEN, TRANSFER_ID_LEN,
};

fn fixed<const N: usize>(data: &[u8], what: &str) -> PyResult<[u8; N]> {
    data.try_into()
        .map_err(|_| PyValueError::new_err(format!("{what} must be {N} bytes, not {}", data.len())))
}

fn role(byte: u8) -> PyResult<Role> {
    match byte {
        1 => Ok(Role::Client),
        2 => Ok(Role::Server),
        other => Err(PyValueError::new_err(format!(
            "role must be 1 or 2, not {other}"
        ))),
    }
}

/// A hello's bytes.
#[pyfunction]
#[pyo3(name = "_protocol_hello")]
pub fn hello<'py>(
    py: Python<'py>,
    role_byte: u8,
    auth: bool,
    nonce: &[u8],
    max_gradient_len: u64,
    max_payload_len: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let hello = Hello {
        role: role(role_byte)?,
        auth,
        nonce: fixed(nonce, "nonce")?,
        max_gradient_len,
        max_payload_len,
        intent: None,
    };
    Ok(PyBytes::new(py, &hello.to_bytes()))
}

/// The bytes a hello's first 16 announce (ProtocolError when they are no hello's).
#[pyfunction]
#[pyo3(name = "_protocol_hello_rest")]
pub fn hello_rest(py: Python<'_>, head: &[u8]) -> PyResult<usize> {
    // Either side's: the whole hello's read (`read_hello`) holds a listener's to version 2.
    Hello::check_start(&fixed::<START_LEN>(head, "head")?, Role::Client, None).py_err(py)?;
    Ok(HELLO_LEN - START_LEN)
}

/// A whole hello read by the side of `own_role`: (role, auth, nonce, max_gradient_len,
/// max_payload_len).
#[pyfunction]
#[pyo3(name = "_protocol_read_hello")]
pub fn read_hello<'py>(
    py: Python<'py>,
    data: &[u8],
    own_role: u8,
) -> PyResult<(u8, u8, Bound<'py, PyBytes>, u64, u32)> {
    let hello = Hello::parse(&fixed(data, "a hello")?, role(own_role)?.peer(), None).py_err(py)?;
    Ok((
        hello.role.byte(),
        u8::from(hello.auth),
        PyBytes::new(py, &hello.nonce),
        hello.max_gradient_len,
        hello.max_payload_len,
    ))
}

/// The key exchange message of the side of `role_byte`, its scalar made of `seed`.
#[pyfunction]
#[pyo3(name = "_protocol_pake")]
pub fn pake<'py>(
    py: Python<'py>,
    key: &[u8],
    role_byte: u8,
    seed: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let seed = ScalarSeed::from_bytes(&fixed::<SEED_LEN>(seed, "a seed")?);
    let exchange = Exchange::start(key, role(role_byte)?, seed);
    Ok(PyBytes::new(py, &exchange.message()))
}

/// The element of a key exchange message (ProtocolError when it is none).
#[pyfunction]
#[pyo3(name = "_protocol_read_pake")]
pub fn read_pake<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let element =
        parse_pake(&fixed::<PAKE_LEN>(data, "a key exchange message")?, None).py_err(py)?;
    Ok(PyBytes::new(py, &element))
}

/// The auth message of the side of `role_byte` (its scalar made of `seed`) once the
/// peer's key exchange message `peer_pake` came, over both hellos.
#[pyfunction]
#[pyo3(name = "_protocol_auth")]
pub fn auth<'py>(
    py: Python<'py>,
    key: &[u8],
    role_byte: u8,
    seed: &[u8],
    peer_pake: &[u8],
    client_hello: &[u8],
    server_hello: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let (client, server) = (
        fixed(client_hello, "a hello")?,
        fixed(server_hello, "a hello")?,
    );
    let side = role(role_byte)?;
    let seed = ScalarSeed::from_bytes(&fixed::<SEED_LEN>(seed, "a seed")?);
    let element = parse_pake(
        &fixed::<PAKE_LEN>(peer_pake, "a key exchange message")?,
        None,
    )
    .py_err(py)?;
    let confirmation = Exchange::start(key, side, seed)
        .finish(&element, side, &client, &server, None)
        .py_err(py)?;
    Ok(PyBytes::new(py, &auth_message(confirmation.tag(side))))
}

/// The tag of an auth message (ProtocolError when it is none).
#[pyfunction]
#[pyo3(name = "_protocol_read_auth")]
pub fn read_auth<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let tag = parse_auth(&fixed::<AUTH_LEN>(data, "an auth message")?, None).py_err(py)?;
    Ok(PyBytes::new(py, &tag))
}

/// A transfer's id.
#[pyfunction]
#[pyo3(name = "_protocol_transfer_id")]
pub fn id<'py>(
    py: Python<'py>,
    client: &[u8],
    server: &[u8],
    direction: u8,
    counter: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    let direction = match direction {
        1 => Direction::ClientToServer,
        2 => Direction::ServerToClient,
        other => {
            return Err(PyValueError::new_err(format!(
                "direction must be 1 or 2, not {other}"
            )))
        }
    };
    let id = transfer_id(
        &fixed(client, "nonce")?,
        &fixed(server, "nonce")?,
        direction,
        counter,
    );
    Ok(PyBytes::new(py, &id))
}

/// The ack digest of a transfer's headers, given whole.
#[pyfunction]
#[pyo3(name = "_protocol_digest")]
pub fn digest<'py>(
    py: Python<'py>,
    transfer: &[u8],
    headers: Vec<Vec<u8>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut digest = Digest::new(&fixed::<TRANSFER_ID_LEN>(transfer, "a transfer id")?);
    for header in headers {
        digest.header(&fixed::<HEADER_LEN>(&header, "a header")?);
    }
    Ok(PyBytes::new(py, &digest.finish()))
}

/// The ack digest of a transfer's frames, fed in `pieces` as they pass a connection.
#[pyfunction]
#[pyo3(name = "_protocol_digest_of_stream")]
pub fn stream_digest<'py>(
    py: Python<'py>,
    transfer: &[u8],
    pieces: Vec<Vec<u8>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let transfer = fixed::<TRANSFER_ID_LEN>(transfer, "a transfer id")?;
    let pieces: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
    Ok(PyBytes::new(py, &digest_of_stream(&transfer, &pieces)))
}

/// An ack's bytes (`reason` None: accepted).
#[pyfunction]
#[pyo3(name = "_protocol_ack")]
pub fn ack<'py>(
    py: Python<'py>,
    counter: u64,
    digest: &[u8],
    reason: Option<String>,
) -> PyResult<Bound<'py, PyBytes>> {
    let ack = match reason {
        None => Ack::accepted(counter, fixed(digest, "a digest")?),
        Some(reason) => Ack::refused(counter, reason),
    };
    Ok(PyBytes::new(py, &ack.to_bytes()))
}

/// The bytes an ack's first 16 announce (ProtocolError when they are no ack's).
#[pyfunction]
#[pyo3(name = "_protocol_ack_rest")]
pub fn ack_rest(py: Python<'_>, head: &[u8]) -> PyResult<usize> {
    Ack::check_start(&fixed(head, "head")?, None).py_err(py)
}

/// A whole ack: (counter, digest, reason or None).
#[pyfunction]
#[pyo3(name = "_protocol_read_ack")]
pub fn read_ack<'py>(
    py: Python<'py>,
    data: &[u8],
) -> PyResult<(u64, Bound<'py, PyBytes>, Option<String>)> {
    let ack = Ack::parse(data, None).py_err(py)?;
    Ok(match ack.verdict {
        gradstream_core::protocol::Verdict::Accepted { digest } => {
            (ack.counter, PyBytes::new(py, &digest), None)
        }
        gradstream_core::protocol::Verdict::Refused { reason } => {
            (ack.counter, PyBytes::new(py, &[0u8; 32]), Some(reason))
        }
    })
}

/// What a peer's first (up to 16) bytes are, as a ProtocolError names them.
#[pyfunction]
#[pyo3(name = "_protocol_describe")]
pub fn describe_start(head: &[u8]) -> String {
    describe(head)
}

/// Add the functions to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hello, m)?)?;
    m.add_function(wrap_pyfunction!(hello_rest, m)?)?;
    m.add_function(wrap_pyfunction!(read_hello, m)?)?;
    m.add_function(wrap_pyfunction!(pake, m)?)?;
    m.add_function(wrap_pyfunction!(read_pake, m)?)?;
    m.add_function(wrap_pyfunction!(auth, m)?)?;
    m.add_function(wrap_pyfunction!(read_auth, m)?)?;
    m.add_function(wrap_pyfunction!(id, m)?)?;
    m.add_function(wrap_pyfunction!(digest, m)?)?;
    m.add_function(wrap_pyfunction!(stream_digest, m)?)?;
    m.add_function(wrap_pyfunction!(ack, m)?)?;
    m.add_function(wrap_pyfunction!(ack_rest, m)?)?;
    m.add_function(wrap_pyfunction!(read_ack, m)?)?;
    m.add_function(wrap_pyfunction!(describe_start, m)?)?;
    Ok(())
}
