use super::*;
use crate::protocol::hello::{Hello, STREAMS_VERSION};
use crate::protocol::testing::{client_hello, hex, server_hello, AUTHKEY, PEER};

fn peer() -> Option<PeerAt> {
    Some(PeerAt::Tcp(PEER))
}

fn expected_of(error: GradientStreamError) -> String {
    match error {
        GradientStreamError::Protocol { expected, .. } => expected,
        other => panic!("not a ProtocolError: {other:?}"),
    }
}

/// The docs/spec/protocol.md "Several streams" vector: K = the bytes 01..20, no TLS, the
/// spec's client and server hellos.
fn vector_secret() -> SessionSecret {
    let key: Vec<u8> = (1..=32).collect();
    let hellos = hellos_hash(&client_hello().to_bytes(), &server_hello().to_bytes());
    SessionSecret::derive(Some(&key), None, &hellos).expect("a secret")
}

#[test]
fn intents_travel_in_a_version_3_client_hello() {
    let session = [0xabu8; SESSION_ID_LEN];
    for intent in [
        Intent::Open {
            streams: 2,
            resume: false,
        },
        Intent::Open {
            streams: 255,
            resume: true,
        },
        Intent::Open {
            streams: 1,
            resume: true,
        },
        Intent::Resume { index: 0, session },
        Intent::Resume {
            index: 254,
            session,
        },
        Intent::Join { index: 1, session },
        Intent::Join {
            index: 254,
            session,
        },
    ] {
        let bytes = client_hello().with_intent(Some(intent)).to_bytes();
        assert_eq!(u16::from_le_bytes([bytes[12], bytes[13]]), STREAMS_VERSION);
        let read = Hello::parse(&bytes, Role::Client, None).expect("parses");
        assert_eq!(read.intent, Some(intent));
        assert_eq!(read.nonce, client_hello().nonce);
    }
    // Without an intent, the hello is version 2, byte for byte as before.
    let plain = client_hello().to_bytes();
    assert_eq!(u16::from_le_bytes([plain[12], plain[13]]), 2);
    assert_eq!(
        Hello::parse(&plain, Role::Client, None).map(|h| h.intent),
        Ok(None)
    );
}

#[test]
fn a_version_3_hello_is_read_strictly() {
    let open = client_hello()
        .with_intent(Some(Intent::Open {
            streams: 4,
            resume: false,
        }))
        .to_bytes();
    let broken = |at: usize, value: u8| {
        let mut bytes = open;
        bytes[at] = value;
        bytes
    };
    for (bytes, what) in [
        (broken(18, 0), "intent 0"),
        (broken(18, 4), "intent 4"),
        (broken(19, 1), "an opening of 1 stream that does not resume"),
        (broken(64, 2), "a resume byte of 2"),
        (broken(70, 1), "a session id in an opening"),
    ] {
        let error = Hello::parse(&bytes, Role::Client, peer().as_ref()).expect_err(what);
        assert!(
            matches!(error, GradientStreamError::Protocol { .. }),
            "{what}"
        );
    }
    let join = client_hello()
        .with_intent(Some(Intent::Join {
            index: 3,
            session: [1; 16],
        }))
        .to_bytes();
    for index in [0, 255] {
        let mut bytes = join;
        bytes[19] = index;
        assert!(Hello::parse(&bytes, Role::Client, None).is_err(), "{index}");
    }
    // A listener never sends version 3: a client refuses it at its first 16 bytes.
    let mut listener = server_hello().to_bytes();
    listener[12] = 3;
    let error = Hello::parse(&listener, Role::Server, None).expect_err("refused");
    assert_eq!(expected_of(error), "a listener's hello of version 2");
}

#[test]
fn the_session_secret_needs_a_key_or_tls_and_binds_both_hellos() {
    let hellos = hellos_hash(&client_hello().to_bytes(), &server_hello().to_bytes());
    assert!(SessionSecret::derive(None, None, &hellos).is_none());
    let exporter = [7u8; 32];
    let ids = [
        SessionSecret::derive(Some(AUTHKEY), None, &hellos),
        SessionSecret::derive(Some(b"another key"), None, &hellos),
        SessionSecret::derive(None, Some(&exporter), &hellos),
        SessionSecret::derive(Some(AUTHKEY), Some(&exporter), &hellos),
        SessionSecret::derive(Some(AUTHKEY), None, &[0; 32]),
    ]
    .map(|s| s.expect("a secret").id());
    for (i, a) in ids.iter().enumerate() {
        for b in &ids[i + 1..] {
            assert_ne!(a, b);
        }
    }
}

#[test]
fn a_join_tag_is_bound_to_its_side_index_hellos_and_tls_session() {
    let secret = vector_secret();
    let (hellos, exporter) = ([5u8; 32], [9u8; 32]);
    let tag = secret.join_tag((Role::Client, Proof::Join), 2, &hellos, Some(&exporter));
    let check = |role, index, hellos: &[u8; 32], exporter: Option<&[u8; 32]>| {
        secret.verify_join((role, Proof::Join), index, hellos, exporter, &tag, None)
    };
    assert!(check(Role::Client, 2, &hellos, Some(&exporter)).is_ok());
    for (result, what) in [
        (
            check(Role::Server, 2, &hellos, Some(&exporter)),
            "reflected",
        ),
        (
            check(Role::Client, 3, &hellos, Some(&exporter)),
            "another index",
        ),
        (
            check(Role::Client, 2, &[6; 32], Some(&exporter)),
            "other hellos",
        ),
        (
            check(Role::Client, 2, &hellos, Some(&[8; 32])),
            "another TLS session",
        ),
        (check(Role::Client, 2, &hellos, None), "no TLS"),
        (
            secret.verify_join(
                (Role::Client, Proof::Resume),
                2,
                &hellos,
                Some(&exporter),
                &tag,
                None,
            ),
            "a join's tag as a resume's",
        ),
    ] {
        assert!(
            matches!(result, Err(GradientStreamError::Authentication { .. })),
            "{what}"
        );
    }
    let stranger = SessionSecret::derive(Some(b"another key"), None, &hellos).expect("one");
    let forged = stranger.join_tag((Role::Client, Proof::Join), 2, &hellos, Some(&exporter));
    assert!(secret
        .verify_join(
            (Role::Client, Proof::Join),
            2,
            &hellos,
            Some(&exporter),
            &forged,
            None
        )
        .is_err());
}

#[test]
fn the_spec_vectors_hold() {
    // docs/spec/protocol.md, "Several streams": tests/connection/test_streams_vectors.py
    // computes the same from the spec's text with Python's hmac.
    let secret = vector_secret();
    assert_eq!(hex(&secret.id()), "0b1bbe36fa45abbd25e01ba4f36f1486");
    let tag = secret.join_tag((Role::Client, Proof::Join), 1, &[0x11; 32], None);
    assert_eq!(
        hex(&tag),
        "aeb2046f65d9817cb9c926d386efd5cad1e81f1b3c5c63721b5111e5e0e8c578"
    );
    // docs/spec/protocol.md, "Resume".
    let tag = secret.join_tag((Role::Client, Proof::Resume), 0, &[0x11; 32], None);
    assert_eq!(hex(&tag), RESUME_VECTOR);
    let state = ResumeState {
        received: 3,
        last_digest: [0xd1; 32],
        held: vec![(0, 5), (7, 8)],
    };
    assert_eq!(hex(&state.to_bytes()), RESUME_MESSAGE_VECTOR);
}

/// The resume tag of the spec's vector (client, stream 0, hellos hash 11 x 32, no TLS).
const RESUME_VECTOR: &str = "bcad521d5fb91624aa3f37361ab51502ba0ddb01f49b63eb10ed3132d18cd7eb";

/// The spec's resume message: 3 transfers taken, digest d1 x 32, chunks 0..5 and 7..8.
const RESUME_MESSAGE_VECTOR: &str = concat!(
    "47535253000000000000000000000000",
    "0300000000000000",
    "d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1",
    "0200000000000000",
    "00000000050000000700000008000000",
);

#[test]
fn a_resume_message_reads_back_and_is_read_strictly() {
    let state = ResumeState {
        received: u64::MAX,
        last_digest: [7; 32],
        held: vec![(0, 3), (4, 9), (100, 101)],
    };
    let bytes = state.to_bytes();
    assert_eq!(bytes.len(), RESUME_LEN + 3 * 8);
    let mut start = [0u8; RESUME_LEN];
    start.copy_from_slice(&bytes[..RESUME_LEN]);
    let (mut read, count) = ResumeState::parse_start(&start, None).expect("parses");
    assert_eq!(count, 3);
    read.parse_ranges(&bytes[RESUME_LEN..], None)
        .expect("ranges");
    assert_eq!(read, state);
    for (index, held) in [
        (0, true),
        (2, true),
        (3, false),
        (4, true),
        (8, true),
        (9, false),
    ] {
        assert_eq!(read.holds(index), held, "{index}");
    }
    assert!(!read.holds(99) && read.holds(100) && !read.holds(101));
    // Ranges out of order, overlapping, adjacent or empty are refused.
    for held in [
        vec![(4, 9), (0, 3)],
        vec![(0, 5), (4, 9)],
        vec![(0, 4), (4, 9)],
        vec![(3, 3)],
        vec![(5, 2)],
    ] {
        let bytes = ResumeState {
            held: held.clone(),
            ..ResumeState::default()
        }
        .to_bytes();
        let mut fresh = ResumeState::default();
        let error = fresh
            .parse_ranges(&bytes[RESUME_LEN..], peer().as_ref())
            .expect_err("refused");
        assert!(
            matches!(error, GradientStreamError::Protocol { .. }),
            "{held:?}"
        );
    }
    // More ranges than the bound, a reserved byte, another magic: refused from the start.
    let mut many = start;
    many[56..60].copy_from_slice(&(MAX_HELD_RANGES + 1).to_le_bytes());
    let mut reserved = start;
    reserved[62] = 1;
    let mut zeros = start;
    zeros[9] = 1;
    let mut magic = start;
    magic[..4].copy_from_slice(b"GSJN");
    for bytes in [many, reserved, zeros, magic] {
        assert!(ResumeState::parse_start(&bytes, None).is_err());
    }
    assert_eq!(
        crate::reassembler::ranges_of([0, 1, 2, 5, 7, 8]),
        vec![(0, 3), (5, 6), (7, 9)]
    );
}

#[test]
fn the_streams_message_grants_one_to_what_was_asked() {
    let grant = |streams, resume| Grant { streams, resume };
    let asked = grant(4, false);
    assert_eq!(
        parse_streams(&streams_message(grant(3, false)), asked, None),
        Ok(grant(3, false))
    );
    assert_eq!(
        parse_streams(&streams_message(grant(1, false)), asked, None),
        Ok(grant(1, false))
    );
    for granted in [0, 5] {
        let message = streams_message(grant(granted, false));
        let error = parse_streams(&message, asked, None).expect_err("refused");
        assert_eq!(expected_of(error), "a grant of 1 to 4 streams");
    }
    // A resume is granted only when asked, and may be refused.
    let resumes = streams_message(grant(2, true));
    let error = parse_streams(&resumes, asked, None).expect_err("not asked");
    assert_eq!(expected_of(error), "a resume byte of 0");
    assert_eq!(
        parse_streams(&resumes, grant(4, true), None),
        Ok(grant(2, true))
    );
    assert_eq!(
        parse_streams(&streams_message(grant(2, false)), grant(4, true), None),
        Ok(grant(2, false))
    );
    let mut two = resumes;
    two[17] = 2;
    assert!(parse_streams(&two, grant(4, true), None).is_err());
    let mut reserved = streams_message(grant(2, false));
    reserved[20] = 1;
    assert!(parse_streams(&reserved, asked, None).is_err());
    let mut zeros = streams_message(grant(2, false));
    zeros[8] = 1;
    assert!(parse_streams(&zeros, asked, None).is_err());
}

#[test]
fn the_join_message_carries_its_tag() {
    let tag = [0x5au8; 32];
    assert_eq!(parse_join(&join_message(tag), None), Ok(tag));
    let mut other = join_message(tag);
    other[..4].copy_from_slice(b"GSAU");
    let error = parse_join(&other, peer().as_ref()).expect_err("refused");
    assert_eq!(expected_of(error), "a join message");
}
