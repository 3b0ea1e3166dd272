//! Transfer ids (docs/spec/protocol.md, step 4): the id each transfer of a connection is
//! sealed with, derived from both hellos' nonces, the direction and a counter, so that a
//! transfer recorded on one connection, reflected back, repeated or dropped is noticed.
//!
//! Uses ring's SHA-256 and `hello::Role`; used by the connection driver.

use ring::digest::{Context, SHA256};

use super::hello::Role;

/// Bytes of a transfer id.
pub const TRANSFER_ID_LEN: usize = 16;

/// Which way a transfer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    ClientToServer,
    ServerToClient,
}

impl Direction {
    /// The direction of the transfers `sender` sends.
    pub const fn sent_by(sender: Role) -> Self {
        match sender {
            Role::Client => Self::ClientToServer,
            Role::Server => Self::ServerToClient,
        }
    }

    /// The byte that stands for the direction in the id's hash input.
    pub const fn byte(self) -> u8 {
        match self {
            Self::ClientToServer => 1,
            Self::ServerToClient => 2,
        }
    }
}

/// `SHA-256("gradstream/1 transfer" || client nonce || server nonce || direction ||
/// counter as u64 LE)[0:16]`: the id of the `counter`-th transfer (from 0) that goes in
/// `direction`.
pub fn transfer_id(
    client_nonce: &[u8; 32],
    server_nonce: &[u8; 32],
    direction: Direction,
    counter: u64,
) -> [u8; TRANSFER_ID_LEN] {
    let mut hash = Context::new(&SHA256);
    hash.update(b"gradstream/1 transfer");
    hash.update(client_nonce);
    hash.update(server_nonce);
    hash.update(&[direction.byte()]);
    hash.update(&counter.to_le_bytes());
    let mut id = [0u8; TRANSFER_ID_LEN];
    id.copy_from_slice(&hash.finish().as_ref()[..TRANSFER_ID_LEN]);
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::testing::{hex, CLIENT_NONCE, SERVER_NONCE};

    #[test]
    fn ids_match_the_readme_vectors() {
        let id = |direction, counter| {
            hex(&transfer_id(
                &CLIENT_NONCE,
                &SERVER_NONCE,
                direction,
                counter,
            ))
        };
        assert_eq!(
            id(Direction::ClientToServer, 0),
            "fb1ea9060e8375d9842202a20885dc6b"
        );
        assert_eq!(
            id(Direction::ServerToClient, 0),
            "59f4109322c9ccbb856d64b3873a95a3"
        );
        assert_eq!(
            id(Direction::ClientToServer, 1),
            "4ed82101c06a79841f8c40f653bf93e2"
        );
    }

    #[test]
    fn each_side_sends_its_own_direction() {
        assert_eq!(Direction::sent_by(Role::Client), Direction::ClientToServer);
        assert_eq!(Direction::sent_by(Role::Server), Direction::ServerToClient);
    }

    #[test]
    fn swapped_nonces_give_other_ids() {
        // A transfer reflected onto a connection whose roles are the other way round.
        assert_ne!(
            transfer_id(&CLIENT_NONCE, &SERVER_NONCE, Direction::ClientToServer, 0),
            transfer_id(&SERVER_NONCE, &CLIENT_NONCE, Direction::ClientToServer, 0)
        );
    }
}
