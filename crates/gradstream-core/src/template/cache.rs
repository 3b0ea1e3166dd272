//! `Templates`: a session's templates, kept so that repeated encodes and decodes of the
//! same value count take the fast path (the module above). A session owns its templates
//! (`SessionConfig::templates`; the configs cloned from it share them) and they go when
//! the last of those goes: nothing here is process-wide.
//!
//! Bounded twice: a number of templates and a number of bytes on each of two shelves. A
//! template is a pure function of (layout, value count, sealed, shape text), so any session may
//! serve any payload of ours; what a peer decides (the sizes of the payloads it sends)
//! can only fill the learned shelf: a peer cycling sizes evicts what other peers taught,
//! never the templates our own senders use. Learning costs two encodes and two decodes of
//! a payload's value count, which a peer paid for with at least 4 bytes a value (see
//! `learn`), so its work per byte received is bounded.
//!
//! A fork needs nothing from us: the shelves carry the id of the process that made them,
//! and a forked child that finds its parent's makes shelves of its own (the parent's are
//! left as they are, never freed: a thread of the parent, which the child does not have,
//! may have held their lock at the fork). Each lock is a plain `Mutex`, held only to look
//! a template up or to put one in, never while one is built.
//!
//! Uses the module above (`Template::build`, `Kind`); used through `Templates` by
//! `encoder`, `rules` and `stream`.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{Kind, Template, MAX_VALUES};
use crate::codec::Layout;

/// Templates kept of the sizes this session's senders chose (two sizes per gradient, full
/// chunks and the tail, per layout, sealed or not).
const MADE_SLOTS: usize = 8;
/// Their bytes: four of the largest (a seed payload of `MAX_VALUES` values, 8 MiB). At
/// the default chunk size (65,536 values) a template is 512 KiB at most.
const MADE_BYTES: usize = 32 << 20;
/// Templates kept of the sizes peers' payloads had (learned on receipt, both layouts).
const LEARNED_SLOTS: usize = 4;
/// Their bytes: two learned counts of the largest (seed and compact, 12 MiB a count).
const LEARNED_BYTES: usize = 24 << 20;

/// A session's templates (see the module comment). Cloning shares them. Two `Templates`
/// compare equal whatever they hold: they are a cache, not a setting.
#[derive(Clone, Default)]
pub struct Templates(Arc<Cache>);

impl PartialEq for Templates {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Templates {}

impl std::fmt::Debug for Templates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (count, bytes) = self.held();
        write!(f, "Templates({count} held, {bytes} bytes)")
    }
}

impl Templates {
    /// No templates yet (none is made until a payload needs one).
    pub fn new() -> Self {
        Self::default()
    }

    /// How many templates are held, and their bytes.
    pub fn held(&self) -> (usize, usize) {
        self.0.shelves().held()
    }

    /// The template of `kind`, from either shelf or built now onto the shelf of sizes our
    /// senders chose. None when it is too large to keep or the writer's output has a shape
    /// we do not know (then the Arrow path is used, with the same result).
    pub(crate) fn get(&self, kind: Kind) -> Option<Arc<Template>> {
        self.0.shelves().get_onto(Shelf::MADE, kind)
    }

    /// The templates held that are `payload_len` bytes long (at most one per layout,
    /// sealed or not, and shelf).
    pub(crate) fn for_payload(&self, payload_len: usize) -> Vec<Arc<Template>> {
        self.0.shelves().find(|t| t.len() == payload_len)
    }

    /// A payload of `payload_len` bytes decoded to `values` values the slow way (sealed or
    /// not): make the templates of that count (on the learned shelf), so later payloads
    /// like it take the fast path.
    pub(crate) fn learn(
        &self,
        values: usize,
        payload_len: usize,
        sealed: bool,
        shape: Option<&str>,
    ) {
        // Any payload of ours is at least 4 bytes a value: a larger count is not ours.
        if values.saturating_mul(4) < payload_len {
            let shelves = self.0.shelves();
            for layout in [Layout::Seed, Layout::Compact] {
                let kind = Kind {
                    layout,
                    values,
                    sealed,
                    shape: shape.map(Arc::from),
                };
                shelves.get_onto(Shelf::LEARNED, kind);
            }
        }
    }
}

/// The shelves of the process that made them, made on first use.
#[derive(Default)]
struct Cache {
    /// Null, or a `Box<Shelves>` turned into a pointer by `shelves_of`; freed by `drop`
    /// when this process made it, else never.
    current: AtomicPtr<Shelves>,
}

impl Cache {
    fn shelves(&self) -> &Shelves {
        self.shelves_of(std::process::id())
    }

    /// The shelves of process `pid` (this one's, but for tests): the current ones when
    /// `pid` made them, else new ones in their place.
    fn shelves_of(&self, pid: u32) -> &Shelves {
        let found = self.current.load(Ordering::Acquire);
        // SAFETY: `current` is null or a pointer from `Box::into_raw` below, freed only by
        // `drop` (which has the cache to itself): valid as long as `self` is borrowed.
        if let Some(shelves) = unsafe { found.as_ref() } {
            if shelves.pid == pid {
                return shelves;
            }
        }
        let fresh = Box::into_raw(Box::new(Shelves::new(pid)));
        match self
            .current
            .compare_exchange(found, fresh, Ordering::AcqRel, Ordering::Acquire)
        {
            // The parent's shelves (`found`, if any) are left as they are: see the module
            // comment.
            // SAFETY: `fresh` is now `current`, freed only by `drop`, as above.
            Ok(_) => unsafe { &*fresh },
            Err(now) => {
                // Another thread of this process put its own in first: ours were never
                // shared.
                // SAFETY: `fresh` came from `Box::into_raw` above and nobody else saw it.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: `now` is non-null (it differs from `found`, and `current` only
                // ever changes to a fresh pointer), from `Box::into_raw` as above.
                unsafe { &*now }
            }
        }
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        let current = *self.current.get_mut();
        // SAFETY: null or from `Box::into_raw` in `shelves_of`; nobody borrows it now.
        let ours = unsafe { current.as_ref() }.is_some_and(|s| s.pid == std::process::id());
        if ours {
            // SAFETY: as above; made by this process, so no thread we lack holds its locks.
            drop(unsafe { Box::from_raw(current) });
        }
    }
}

/// The two shelves of one process.
struct Shelves {
    pid: u32,
    made: Mutex<Shelf>,
    learned: Mutex<Shelf>,
}

impl Shelves {
    fn new(pid: u32) -> Self {
        Self {
            pid,
            made: Mutex::new(Shelf::new(MADE_SLOTS, MADE_BYTES)),
            learned: Mutex::new(Shelf::new(LEARNED_SLOTS, LEARNED_BYTES)),
        }
    }

    fn shelf(&self, which: bool) -> MutexGuard<'_, Shelf> {
        let shelf = if which == Shelf::MADE {
            &self.made
        } else {
            &self.learned
        };
        // A panic while the lock was held cannot leave the list half-changed (push and
        // remove are whole).
        shelf.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn find(&self, keep: impl Fn(&Template) -> bool + Copy) -> Vec<Arc<Template>> {
        let mut found = self.shelf(Shelf::MADE).find(keep);
        found.extend(self.shelf(Shelf::LEARNED).find(keep));
        found
    }

    fn held(&self) -> (usize, usize) {
        let (made, learned) = (self.shelf(Shelf::MADE), self.shelf(Shelf::LEARNED));
        (
            made.list.len() + learned.list.len(),
            made.bytes + learned.bytes,
        )
    }

    /// The template of `kind`, from either shelf or built onto shelf `which`.
    fn get_onto(&self, which: bool, kind: Kind) -> Option<Arc<Template>> {
        if kind.values == 0 || kind.values > MAX_VALUES {
            return None;
        }
        if let Some(found) = self.find(|t| t.kind == kind).into_iter().next() {
            return Some(found);
        }
        // Built with no lock held (two threads may build the same one: `put` keeps one).
        let built = Arc::new(Template::build(kind)?);
        Some(self.shelf(which).put(built))
    }
}

/// A bounded list of templates, oldest first out.
struct Shelf {
    slots: usize,
    max_bytes: usize,
    /// The bytes of the templates in `list`.
    bytes: usize,
    list: Vec<Arc<Template>>,
}

impl Shelf {
    const MADE: bool = true;
    const LEARNED: bool = false;

    fn new(slots: usize, max_bytes: usize) -> Self {
        Self {
            slots,
            max_bytes,
            bytes: 0,
            list: Vec::new(),
        }
    }

    fn find(&self, keep: impl Fn(&Template) -> bool) -> Vec<Arc<Template>> {
        self.list.iter().filter(|t| keep(t)).cloned().collect()
    }

    /// Put `template` on the shelf (unless one of its kind is there already: then that
    /// one), the oldest ones out until the shelf is within its bounds again.
    fn put(&mut self, template: Arc<Template>) -> Arc<Template> {
        if let Some(there) = self.list.iter().find(|t| t.kind == template.kind) {
            return there.clone();
        }
        self.bytes += template.len();
        self.list.push(template.clone());
        while self.list.len() > 1 && (self.list.len() > self.slots || self.bytes > self.max_bytes) {
            let old = self.list.remove(0);
            self.bytes -= old.len();
        }
        template
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(layout: Layout, values: usize, sealed: bool) -> Kind {
        Kind {
            layout,
            values,
            sealed,
            shape: None,
        }
    }

    #[test]
    fn what_peers_teach_never_evicts_what_senders_made() {
        let templates = Templates::new();
        let made = templates
            .get(kind(Layout::Compact, 300, false))
            .expect("a template of ours");
        // A peer cycling through 20 payload sizes, each learned in both layouts.
        for n in 1..=20 {
            templates.learn(1000 + n, 8 * (1000 + n) + 600, n % 2 == 0, None);
        }
        let shelves = templates.0.shelves();
        let again = shelves
            .find(|t| t.kind == kind(Layout::Compact, 300, false))
            .pop()
            .expect("still on its shelf");
        assert!(Arc::ptr_eq(&made, &again));
        assert_eq!(shelves.shelf(Shelf::LEARNED).list.len(), LEARNED_SLOTS);
        assert_eq!(shelves.shelf(Shelf::MADE).list.len(), 1);
        // A count no payload of ours could carry in that many bytes is not learned.
        let before = shelves.shelf(Shelf::LEARNED).find(|_| true);
        templates.learn(5000, 5000, false, None);
        let after = shelves.shelf(Shelf::LEARNED).find(|_| true);
        assert!(before.iter().zip(&after).all(|(a, b)| Arc::ptr_eq(a, b)));
        // What was learned serves a payload of that size, sealed as it was.
        let last = shelves
            .shelf(Shelf::LEARNED)
            .find(|t| t.kind.values == 1020);
        assert_eq!(last.len(), 2);
        assert!(last.iter().all(|t| t.kind.sealed));
    }

    #[test]
    fn the_shelves_stay_within_their_bytes() {
        let templates = Templates::new();
        // Seed templates of the largest count: 8 MiB each, so four fit the made shelf.
        for sealed in [false, true] {
            for values in [MAX_VALUES, MAX_VALUES - 1, MAX_VALUES - 2] {
                assert!(templates.get(kind(Layout::Seed, values, sealed)).is_some());
            }
        }
        let (count, bytes) = templates.held();
        assert!(bytes <= MADE_BYTES, "{bytes}");
        assert_eq!(count, 3, "three 8 MiB templates and a little fit 32 MiB");
        // The newest is the one kept.
        let newest = kind(Layout::Seed, MAX_VALUES - 2, true);
        assert!(templates.0.shelves().find(|t| t.kind == newest).len() == 1);
    }

    #[test]
    fn two_sessions_hold_their_own_templates_and_clones_share() {
        let (one, other) = (Templates::new(), Templates::new());
        let shared = one.clone();
        let a = one.get(kind(Layout::Compact, 100, false)).unwrap();
        assert_eq!(one.held().0, 1);
        assert_eq!(other.held(), (0, 0));
        let b = shared.get(kind(Layout::Compact, 100, false)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        // Built again by the other: the same bytes, its own copy.
        let c = other.get(kind(Layout::Compact, 100, false)).unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(a.bytes, c.bytes);
    }

    #[test]
    fn a_forked_child_makes_its_own_shelves_even_with_the_parents_locks_held() {
        let templates = Templates::new();
        let parent = std::process::id();
        templates.get(kind(Layout::Compact, 100, false)).unwrap();
        // A thread of the parent in the middle of a lookup when the fork came: its guard
        // is never dropped in the child.
        std::mem::forget(templates.0.shelves_of(parent).shelf(Shelf::MADE));
        let child = parent.wrapping_add(1);
        let shelves = templates.0.shelves_of(child);
        assert_eq!(shelves.pid, child);
        assert_eq!(shelves.held(), (0, 0));
        assert!(shelves
            .get_onto(Shelf::MADE, kind(Layout::Compact, 100, false))
            .is_some());
        assert_eq!(templates.0.shelves_of(child).held().0, 1);
        // These shelves are not this test process's own: dropping the cache leaves them.
    }
}
