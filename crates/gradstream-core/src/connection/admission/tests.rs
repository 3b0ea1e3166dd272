//! The admission tables alone, with the time given: the pending table's caps and whom
//! it drops, the failure table's lockout, its window and its bound.

use super::*;

fn settings(cap: usize, per_source: usize) -> Admission {
    Admission {
        max_pending_handshakes: cap,
        max_pending_per_source: per_source,
        ..Admission::default()
    }
}

fn v4(last: u8) -> Source {
    Source::of(IpAddr::from([10, 0, 0, last]))
}

/// Admit a peer from `source` under `ticket`-named handles; its `Heard`.
fn admit(
    table: &mut PendingTable<u64>,
    source: Source,
) -> Result<(u64, Arc<Heard>, Option<u64>), Shed> {
    let dropped = table.make_room(source)?;
    let heard = Arc::new(Heard::default());
    let ticket = table.ticket();
    table.insert(ticket, source, heard.clone(), ticket);
    Ok((ticket, heard, dropped))
}

#[test]
fn sources_are_ipv4_addresses_and_ipv6_slash_64s() {
    let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
    assert_eq!(Source::of(mapped), v4(1));
    let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
    let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
    let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
    assert_eq!(Source::of(a), Source::of(b));
    assert_ne!(Source::of(a), Source::of(c));
    assert_eq!(Source::of(a).to_string(), "2001:db8:1:2::/64");
    assert_eq!(v4(7).to_string(), "10.0.0.7");
}

#[test]
fn a_full_source_drops_its_own_oldest_silent_handshake_not_anothers() {
    let mut table = PendingTable::new(&settings(100, 3));
    let (other, _, _) = admit(&mut table, v4(9)).unwrap();
    let first: Vec<_> = (0..3).map(|_| admit(&mut table, v4(1)).unwrap()).collect();
    // The oldest of 10.0.0.1 has spoken: the next silent one gives way.
    first[0].1.handshake_bytes(5);
    let (_, _, dropped) = admit(&mut table, v4(1)).unwrap();
    assert_eq!(dropped, Some(first[1].0));
    assert_eq!(table.len(), 4);
    // All of 10.0.0.1's have spoken: its newcomer is refused; 10.0.0.9's stays.
    assert_eq!(
        table.pending.values().filter(|p| p.source == v4(1)).count(),
        3
    );
    for p in table.pending.values().filter(|p| p.source == v4(1)) {
        p.heard.first_byte();
    }
    assert_eq!(
        admit(&mut table, v4(1)).unwrap_err(),
        Shed::SourceBusy {
            source: v4(1),
            cap: 3
        }
    );
    assert!(table.pending.contains_key(&other));
}

#[test]
fn a_full_table_drops_the_oldest_silent_handshake_of_any_source() {
    let mut table = PendingTable::new(&settings(4, 4));
    let tickets: Vec<_> = (0..4).map(|i| admit(&mut table, v4(i)).unwrap()).collect();
    tickets[0].1.first_byte();
    let (_, _, dropped) = admit(&mut table, v4(200)).unwrap();
    assert_eq!(dropped, Some(tickets[1].0));
    assert_eq!(table.len(), 4);
    for p in table.pending.values() {
        p.heard.first_byte();
    }
    assert_eq!(
        admit(&mut table, v4(201)).unwrap_err(),
        Shed::Busy { cap: 4 }
    );
    // A finished handshake frees its place in all and in its source.
    assert_eq!(table.finish(tickets[0].0), Some(tickets[0].0));
    assert_eq!(table.finish(tickets[0].0), None);
    assert!(admit(&mut table, v4(0)).unwrap().2.is_none());
    assert!(table.by_source.values().all(|&n| n == 1));
}

#[test]
fn a_flood_from_one_source_leaves_room_for_the_others() {
    let mut table = PendingTable::new(&Admission::default());
    for _ in 0..10_000 {
        admit(&mut table, v4(2)).unwrap();
    }
    assert_eq!(table.len(), Admission::default().max_pending_per_source);
    assert!(admit(&mut table, v4(1)).unwrap().2.is_none());
}

fn guessing(most: u32, window_s: u64) -> Admission {
    Admission {
        max_auth_failures: most,
        auth_failure_window: Duration::from_secs(window_s),
        ..Admission::default()
    }
}

#[test]
fn a_source_is_refused_after_its_failures_until_its_window_ends() {
    let mut table = FailureTable::new(&guessing(3, 60));
    let t0 = Instant::now();
    for i in 0..2 {
        table.failed(v4(1), t0 + Duration::from_secs(i));
        assert_eq!(table.refused(v4(1), t0 + Duration::from_secs(i)), None);
    }
    table.failed(v4(1), t0 + Duration::from_secs(10));
    let refused = table.refused(v4(1), t0 + Duration::from_secs(20));
    assert_eq!(
        refused,
        Some(Shed::Guessing {
            source: v4(1),
            failures: 3,
            window: Duration::from_secs(60),
            retry_in: Duration::from_secs(40),
        })
    );
    assert_eq!(
        refused.unwrap().to_string(),
        "3 failed authentications from 10.0.0.1 within auth_failure_window (60 s): its \
         connections are refused for 40.0 s more (a peer with another authkey, or one \
         guessing it)"
    );
    // Another source is not.
    assert_eq!(table.refused(v4(2), t0 + Duration::from_secs(20)), None);
    // The window ends: served again, and counted afresh.
    let later = t0 + Duration::from_secs(60);
    assert_eq!(table.refused(v4(1), later), None);
    table.failed(v4(1), later);
    assert_eq!(table.refused(v4(1), later), None);
}

#[test]
fn failures_spread_over_more_than_a_window_never_lock_a_source_out() {
    let mut table = FailureTable::new(&guessing(3, 60));
    let t0 = Instant::now();
    for i in 0..100 {
        let now = t0 + Duration::from_secs(31 * i);
        table.failed(v4(1), now);
        assert_eq!(table.refused(v4(1), now), None, "failure {i}");
    }
}

#[test]
fn the_failure_table_holds_at_most_its_capacity() {
    let mut table = FailureTable::with_capacity(&guessing(2, 60), 8);
    let t0 = Instant::now();
    table.failed(v4(0), t0);
    table.failed(v4(0), t0);
    assert!(table.refused(v4(0), t0).is_some());
    // Windows still running: one entry gives way at a time (not the locked-out one:
    // see the next test).
    for i in 1..=20u8 {
        table.failed(v4(i), t0 + Duration::from_millis(u64::from(i)));
        assert!(table.len() <= 8);
    }
    assert_eq!(table.len(), 8);
    assert!(table.refused(v4(0), t0).is_some());
    // Ended windows go first, all at once.
    let later = t0 + Duration::from_secs(61);
    table.failed(v4(100), later);
    assert_eq!(table.len(), 1);
}

#[test]
fn the_defaults_are_the_documented_ones() {
    let defaults = Admission::default();
    assert_eq!(defaults.max_pending_handshakes, 256);
    assert_eq!(defaults.max_pending_per_source, 64);
    assert_eq!(defaults.hello_timeout, Duration::from_secs(3));
    assert_eq!(defaults.max_auth_failures, 10);
    assert_eq!(defaults.auth_failure_window, Duration::from_secs(60));
    assert_eq!(FAILURE_TABLE, 4096);
}

#[test]
fn fresh_sources_filling_the_failure_table_do_not_free_a_locked_out_one() {
    // A guesser with many sources (IPv6 /64s by the thousand) fails once from each fresh
    // one: the sources below the limit give way, the locked-out one stays refused.
    let mut table = FailureTable::with_capacity(&guessing(2, 60), 8);
    let t0 = Instant::now();
    table.failed(v4(0), t0);
    table.failed(v4(0), t0);
    for i in 1..=50u8 {
        table.failed(v4(i), t0 + Duration::from_millis(u64::from(i)));
        assert!(table.len() <= 8);
        assert!(
            table.refused(v4(0), t0 + Duration::from_secs(1)).is_some(),
            "{i}"
        );
    }
    // Only when every source is locked out does the one whose window began first go.
    let mut table = FailureTable::with_capacity(&guessing(1, 60), 2);
    table.failed(v4(1), t0);
    table.failed(v4(2), t0 + Duration::from_secs(1));
    table.failed(v4(3), t0 + Duration::from_secs(2));
    assert!(table.refused(v4(1), t0 + Duration::from_secs(3)).is_none());
    assert!(table.refused(v4(2), t0 + Duration::from_secs(3)).is_some());
}

#[test]
fn a_window_past_the_clocks_range_refuses_without_panicking() {
    let mut table = FailureTable::new(&Admission {
        max_auth_failures: 1,
        auth_failure_window: Duration::MAX,
        ..Admission::default()
    });
    let t0 = Instant::now();
    table.failed(v4(1), t0);
    assert!(table
        .refused(v4(1), t0 + Duration::from_secs(3600))
        .is_some());
}
