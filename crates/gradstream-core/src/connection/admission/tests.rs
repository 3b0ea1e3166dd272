//! The admission tables alone, with the time given: the pending table's caps, whom it
//! evicts and when, its queue of waiting connections; the failure table's lockout, its
//! window and its bound.

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

/// A pending table of connections named by numbers, whose handles are their tickets,
/// with the time given in milliseconds from its start; and the handshakes it began.
struct Bench {
    table: PendingTable<u32, u64>,
    began: Vec<(u64, u32, Arc<Heard>)>,
    t0: Instant,
}

type Gones = Vec<Gone<u32, u64>>;

impl Bench {
    fn new(cap: usize, per_source: usize) -> Self {
        Self {
            table: PendingTable::new(&settings(cap, per_source)),
            began: Vec::new(),
            t0: Instant::now(),
        }
    }

    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn arrive(&mut self, source: Source, id: u32, ms: u64) -> Gones {
        let now = self.at(ms);
        let began = &mut self.began;
        self.table.arrive(source, id, now, |ticket, _, id, heard| {
            began.push((ticket, id, heard));
            ticket
        })
    }

    fn place(&mut self, ms: u64) -> Gones {
        let now = self.at(ms);
        let began = &mut self.began;
        self.table.place(now, |ticket, _, id, heard| {
            began.push((ticket, id, heard));
            ticket
        })
    }

    fn began(&self, id: u32) -> Option<&(u64, u32, Arc<Heard>)> {
        self.began.iter().find(|(_, i, _)| *i == id)
    }

    fn ticket(&self, id: u32) -> u64 {
        self.began(id).expect("began").0
    }

    fn speaks(&self, id: u32) {
        self.began(id).expect("began").2.handshake_bytes(80);
    }

    /// `id`'s handshake ends at `ms`: what waits takes its place.
    fn ends(&mut self, id: u32, ms: u64) -> Gones {
        let ticket = self.ticket(id);
        assert_eq!(self.table.finish(ticket), Some(ticket));
        self.place(ms)
    }
}

const GRACE_MS: u64 = 250;

#[test]
fn the_grace_is_the_documented_one() {
    assert_eq!(EVICTION_GRACE, Duration::from_millis(GRACE_MS));
}

#[test]
fn a_burst_from_one_source_larger_than_both_caps_is_all_served() {
    // 4 per source, 8 in all, so 8 may wait: 12 peers of one host connect at once.
    // Accepted together, none has been read yet, so all look silent: before, the 5th
    // evicted the 1st, and so on (the 300 workers of a parameter server were reset);
    // now the ones past the cap wait, and begin as handshakes end.
    let mut bench = Bench::new(8, 4);
    for id in 0..12 {
        assert_eq!(bench.arrive(v4(1), id, 0), vec![], "{id}");
    }
    assert_eq!((bench.table.len(), bench.table.waiting()), (4, 8));
    let mut ms = 1;
    let mut ended = 0;
    while ended < 12 {
        let id = bench.began[ended].1;
        bench.speaks(id);
        assert_eq!(bench.ends(id, ms), vec![], "{id}");
        ended += 1;
        ms += 1;
    }
    let mut ids: Vec<_> = bench.began.iter().map(|(_, id, _)| *id).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..12).collect::<Vec<_>>());
    assert_eq!((bench.table.len(), bench.table.waiting()), (0, 0));
}

#[test]
fn a_silent_handshake_gives_way_only_once_under_way_for_the_grace() {
    let mut bench = Bench::new(100, 2);
    bench.arrive(v4(1), 0, 0);
    bench.arrive(v4(1), 1, 10);
    // Both silent, within their grace: the third waits, and the table says when to
    // look again (the oldest silent one's grace ends).
    assert_eq!(bench.arrive(v4(1), 2, 100), vec![]);
    assert!(bench.began(2).is_none());
    assert_eq!(
        bench.table.next_wake(bench.at(100)),
        Some(bench.at(GRACE_MS))
    );
    assert_eq!(bench.place(GRACE_MS - 1), vec![]);
    assert!(bench.began(2).is_none());
    // Its grace over, the oldest silent one gives way.
    let first = bench.ticket(0);
    assert_eq!(bench.place(GRACE_MS), vec![Gone::Evicted(first)]);
    assert!(bench.began(2).is_some());
    // One that spoke is never evicted, however old; a silent one past its grace is.
    bench.speaks(1);
    let third = bench.ticket(2);
    assert_eq!(bench.arrive(v4(1), 3, 1000), vec![Gone::Evicted(third)]);
    // None silent: the next waits, however long, with no wake (only a handshake's end
    // makes room), and begins when one ends.
    bench.speaks(3);
    assert_eq!(bench.arrive(v4(1), 4, 5000), vec![]);
    assert!(bench.began(4).is_none());
    assert_eq!(bench.table.next_wake(bench.at(5000)), None);
    assert_eq!(bench.ends(1, 5001), vec![]);
    assert!(bench.began(4).is_some());
}

#[test]
fn a_full_source_evicts_its_own_oldest_silent_handshake_not_anothers() {
    let mut bench = Bench::new(100, 3);
    bench.arrive(v4(9), 9, 0);
    for id in 0..3 {
        bench.arrive(v4(1), id, 0);
    }
    // The oldest of 10.0.0.1 has spoken: the next silent one gives way (10.0.0.9's,
    // older and silent, stays).
    bench.speaks(0);
    let second = bench.ticket(1);
    assert_eq!(
        bench.arrive(v4(1), 3, GRACE_MS),
        vec![Gone::Evicted(second)]
    );
    assert_eq!(bench.table.len(), 4);
    assert!(bench.table.pending.contains_key(&bench.ticket(9)));
}

#[test]
fn a_full_table_evicts_the_oldest_silent_handshake_of_any_source() {
    let mut bench = Bench::new(4, 4);
    for id in 0..4u8 {
        bench.arrive(v4(id), u32::from(id), 0);
    }
    bench.speaks(0);
    let second = bench.ticket(1);
    assert_eq!(
        bench.arrive(v4(200), 200, GRACE_MS),
        vec![Gone::Evicted(second)]
    );
    assert_eq!(bench.table.len(), 4);
    for id in [0, 2, 3, 200] {
        bench.speaks(id);
    }
    // None silent: the newcomer waits (before: it was closed at once)...
    assert_eq!(bench.arrive(v4(201), 201, 2 * GRACE_MS), vec![]);
    assert!(bench.began(201).is_none());
    // ...until a handshake ends, which frees its place in all and in its source.
    assert_eq!(bench.ends(0, 2 * GRACE_MS + 1), vec![]);
    assert!(bench.began(201).is_some());
    assert!(bench.table.by_source.values().all(|&n| n == 1));
}

#[test]
fn a_flood_from_one_source_leaves_room_for_the_others() {
    let defaults = Admission::default();
    let mut bench = Bench::new(
        defaults.max_pending_handshakes,
        defaults.max_pending_per_source,
    );
    for id in 0..10_000 {
        // A millisecond apart: silent ones past their grace give way to newer silent ones.
        bench.arrive(v4(2), id, u64::from(id));
        assert!(bench.table.len() <= defaults.max_pending_per_source);
        assert!(bench.table.waiting() <= defaults.max_pending_handshakes);
    }
    assert_eq!(bench.table.len(), defaults.max_pending_per_source);
    assert_eq!(bench.table.waiting(), defaults.max_pending_handshakes);
    // Another source begins at once, and its arrival pushes out none of the waiting.
    assert_eq!(bench.arrive(v4(1), 99_999, 9_999), vec![]);
    assert!(bench.began(99_999).is_some());
}

#[test]
fn a_full_queue_pushes_out_the_oldest_waiting_of_the_newcomers_source_else_of_all() {
    let mut bench = Bench::new(2, 2);
    for id in 0..2 {
        bench.arrive(v4(1), id, 0);
        bench.speaks(id);
    }
    assert_eq!(bench.arrive(v4(1), 2, 0), vec![]);
    assert_eq!(bench.arrive(v4(2), 10, 0), vec![]);
    assert_eq!(bench.table.waiting(), 2);
    let displaced = |own_source| Shed::Displaced {
        waiting: 2,
        own_source,
    };
    let (own, any) = (displaced(true), displaced(false));
    assert_eq!(
        bench.arrive(v4(1), 3, 1),
        vec![Gone::Displaced(2, own.clone())]
    );
    // 10.0.0.3 waits nowhere yet: the oldest waiting of all (10.0.0.2's) goes.
    assert_eq!(
        bench.arrive(v4(3), 20, 2),
        vec![Gone::Displaced(10, any.clone())]
    );
    assert_eq!(bench.table.waiting(), 2);
    assert_eq!(
        own.to_string(),
        "waited for a place among the handshakes under way while 2 connections waited \
         (max_pending_handshakes), and was the oldest waiting of the newcomer's source when \
         a newer one arrived: closed"
    );
    assert!(any.to_string().contains("the oldest waiting of all when"));
    // A locked-out source's waiting connections are taken out.
    assert_eq!(bench.table.remove_waiting(v4(1)), vec![3]);
    assert_eq!(bench.table.waiting(), 1);
    assert_eq!(bench.table.next_wake(bench.at(3)), None);
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
