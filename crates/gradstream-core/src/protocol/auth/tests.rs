//! The authkey's exchange (docs/spec/protocol.md, step 3, and its test vectors).

use super::*;
use crate::protocol::describe::protocol_error;
use crate::protocol::testing::{
    client_hello, hex, server_hello, AUTHKEY, CLIENT_NONCE, PEER, SERVER_NONCE,
};

fn hellos() -> ([u8; HELLO_LEN], [u8; HELLO_LEN]) {
    (client_hello().to_bytes(), server_hello().to_bytes())
}

/// Both sides' exchanges with the vectors' seeds: (client, server).
fn exchanges(client_key: &[u8], server_key: &[u8]) -> (Exchange, Exchange) {
    (
        Exchange::start(
            client_key,
            Role::Client,
            ScalarSeed::for_test(&CLIENT_NONCE),
        ),
        Exchange::start(
            server_key,
            Role::Server,
            ScalarSeed::for_test(&SERVER_NONCE),
        ),
    )
}

fn element(exchange: &Exchange) -> [u8; ELEMENT_LEN] {
    parse_pake(&exchange.message(), None).unwrap()
}

/// Both sides' confirmations over the hellos each saw.
fn confirmations(
    client_key: &[u8],
    server_key: &[u8],
    client_saw: ([u8; HELLO_LEN], [u8; HELLO_LEN]),
    server_saw: ([u8; HELLO_LEN], [u8; HELLO_LEN]),
) -> (Confirmation, Confirmation) {
    let (client, server) = exchanges(client_key, server_key);
    let (from_client, from_server) = (element(&client), element(&server));
    let c = client
        .finish(
            &from_server,
            Role::Client,
            &client_saw.0,
            &client_saw.1,
            None,
        )
        .unwrap();
    let s = server
        .finish(
            &from_client,
            Role::Server,
            &server_saw.0,
            &server_saw.1,
            None,
        )
        .unwrap();
    (c, s)
}

#[test]
fn the_messages_match_the_spec_vectors() {
    let (client, server) = exchanges(AUTHKEY, AUTHKEY);
    assert_eq!(hex(&client.message()), VECTOR_CLIENT_PAKE);
    assert_eq!(hex(&server.message()), VECTOR_SERVER_PAKE);
    let (c, s) = confirmations(AUTHKEY, AUTHKEY, hellos(), hellos());
    assert_eq!(hex(&auth_message(c.tag(Role::Client))), VECTOR_CLIENT_AUTH);
    assert_eq!(hex(&auth_message(s.tag(Role::Server))), VECTOR_SERVER_AUTH);
}

// The vectors of docs/spec/protocol.md, as tests/support/peer/vectors.py writes them
// (tests/connection/vectors/messages.json) with PyPI's spake2.
const VECTOR_CLIENT_PAKE: &str = concat!(
    "4753504b000000000000000000000000",
    "a487d3dd8514c16dcac555753c5afbf2621d2d273606896bc38ea352217bec70"
);
const VECTOR_SERVER_PAKE: &str = concat!(
    "4753504b000000000000000000000000",
    "34ebdfd3899282f649cd15e56327bcae868fe9ecc58212f52a6dc65d94f0a057"
);
const VECTOR_CLIENT_AUTH: &str = concat!(
    "47534155000000000000000000000000",
    "bc7682c62521040cea16c4dfe29877129bad5a7cafea6ce62dd2d5b9e3e7dbe0"
);
const VECTOR_SERVER_AUTH: &str = concat!(
    "47534155000000000000000000000000",
    "3b3605d87ad266a3d889242e0378485046fb117b0a09eab7c3db650c28767500"
);

#[test]
fn the_same_key_confirms_both_ways() {
    let (c, s) = confirmations(AUTHKEY, AUTHKEY, hellos(), hellos());
    assert_eq!(c.verify(Role::Server, &s.tag(Role::Server), None), Ok(()));
    assert_eq!(s.verify(Role::Client, &c.tag(Role::Client), None), Ok(()));
    // Fresh seeds give fresh elements, and still the same key on both sides.
    let fresh = |role| Exchange::start(AUTHKEY, role, ScalarSeed::fresh().unwrap());
    let (a, b) = (fresh(Role::Client), fresh(Role::Server));
    assert_ne!(element(&a), element(&exchanges(AUTHKEY, AUTHKEY).0));
    let (ea, eb) = (element(&a), element(&b));
    let (c, s) = hellos();
    let ca = a.finish(&eb, Role::Client, &c, &s, None).unwrap();
    let cb = b.finish(&ea, Role::Server, &c, &s, None).unwrap();
    assert_eq!(ca.tag(Role::Client), cb.tag(Role::Client));
}

fn refused(result: Result<()>) {
    assert_eq!(
        result,
        Err(authentication_error(
            "the peer's tag does not match: another authkey, or a message changed on the way",
            Some(&PeerAt::Tcp(PEER))
        ))
    );
}

#[test]
fn another_key_is_refused_on_both_sides() {
    let (c, s) = confirmations(
        b"correct horse battery stapler",
        AUTHKEY,
        hellos(),
        hellos(),
    );
    refused(c.verify(Role::Server, &s.tag(Role::Server), Some(&PeerAt::Tcp(PEER))));
    refused(s.verify(Role::Client, &c.tag(Role::Client), Some(&PeerAt::Tcp(PEER))));
}

#[test]
fn a_reflected_tag_is_refused() {
    let (c, _) = confirmations(AUTHKEY, AUTHKEY, hellos(), hellos());
    refused(c.verify(Role::Server, &c.tag(Role::Client), Some(&PeerAt::Tcp(PEER))));
}

#[test]
fn a_reflected_element_is_refused() {
    let (client, _) = exchanges(AUTHKEY, AUTHKEY);
    let own = element(&client);
    let (c, s) = hellos();
    assert_eq!(
        client
            .finish(&own, Role::Client, &c, &s, Some(&PeerAt::Tcp(PEER)))
            .err(),
        Some(authentication_error(
            "the peer's key exchange message is this side's own, sent back",
            Some(&PeerAt::Tcp(PEER))
        ))
    );
}

#[test]
fn a_hello_changed_on_the_way_is_refused() {
    // A man in the middle lowers a limit the client sees in the server's hello.
    let (c, s) = hellos();
    let mut edited = s;
    edited[60] ^= 1;
    let (client, server) = confirmations(AUTHKEY, AUTHKEY, (c, edited), (c, s));
    refused(server.verify(
        Role::Client,
        &client.tag(Role::Client),
        Some(&PeerAt::Tcp(PEER)),
    ));
    refused(client.verify(
        Role::Server,
        &server.tag(Role::Server),
        Some(&PeerAt::Tcp(PEER)),
    ));
}

#[test]
fn points_outside_the_prime_order_group_are_protocol_errors() {
    let message = |element: [u8; 32]| {
        let mut out = [0u8; PAKE_LEN];
        out[..4].copy_from_slice(b"GSPK");
        out[START_LEN..].copy_from_slice(&element);
        out
    };
    let mut identity = [0u8; 32];
    identity[0] = 1; // y = 1: the neutral element
    let mut order_two = [0u8; 32];
    order_two[0] = 0xec; // y = -1 (p - 1): the point of order 2
    order_two[1..31].fill(0xff);
    order_two[31] = 0x7f;
    let mut not_a_point = [0u8; 32];
    not_a_point[0] = 2; // y = 2: x^2 is not a square
    for bad in [identity, order_two, not_a_point] {
        assert_eq!(
            parse_pake(&message(bad), Some(&PeerAt::Tcp(PEER))),
            Err(protocol_error(
                "a point of Ed25519's prime-order group in a key exchange message",
                format!("bytes {}", hex(&bad)),
                Some(&PeerAt::Tcp(PEER))
            ))
        );
    }
}

#[test]
fn malformed_messages_are_protocol_errors() {
    let mut bytes = auth_message([7; 32]);
    bytes[9] = 1;
    assert_eq!(
        parse_auth(&bytes, None),
        Err(protocol_error(
            "zero bytes at offsets 4..15 of an authentication message",
            "000000000001000000000000",
            None
        ))
    );
    let (client, _) = exchanges(AUTHKEY, AUTHKEY);
    let mut pake = client.message();
    pake[15] = 1;
    assert_eq!(
        parse_pake(&pake, None),
        Err(protocol_error(
            "zero bytes at offsets 4..15 of a key exchange message",
            "000000000000000000000001",
            None
        ))
    );
    // A tag where the element belongs, and a hello where a tag belongs.
    assert_eq!(
        parse_pake(&auth_message([7; 32]), Some(&PeerAt::Tcp(PEER))).err(),
        Some(protocol_error(
            "a key exchange message",
            format!("an authentication message (47534155{})", "0".repeat(24)),
            Some(&PeerAt::Tcp(PEER))
        ))
    );
    let mut hello_instead = [0u8; AUTH_LEN];
    hello_instead.copy_from_slice(&client_hello().to_bytes()[..AUTH_LEN]);
    assert_eq!(
        parse_auth(&hello_instead, Some(&PeerAt::Tcp(PEER))),
        Err(protocol_error(
            "an authentication message",
            "a hello of version 2 (80 bytes)",
            Some(&PeerAt::Tcp(PEER))
        ))
    );
}

#[test]
fn both_sides_must_agree_on_an_authkey() {
    assert_eq!(check_modes(true, true, None), Ok(()));
    assert_eq!(check_modes(false, false, None), Ok(()));
    assert_eq!(
        check_modes(true, false, None).map_err(|e| e.to_string()),
        Err(
            "authentication with the peer failed: this side requires an authkey and the \
             peer's hello offers none"
                .into()
        )
    );
    assert_eq!(
        check_modes(false, true, Some(&PeerAt::Tcp(PEER))).map_err(|e| e.to_string()),
        Err(
            "authentication with 127.0.0.1:7000 failed: the peer requires an authkey \
             and this side has none (give authkey=)"
                .into()
        )
    );
}
