//! The level-triggered core of every watch: what a watcher knows, and how a raw store event or
//! a fresh listing changes it. Pure, shared by every backend.
//!
//! Backends feed [`RawEvent`]s: a `Resync` with a full listing (first, and again after any gap:
//! lag, overflow, reconnect, compaction, or a periodic safety net), then `Put`/`Delete`. A
//! resync is diffed against the known set, so it emits exactly the removals and upserts that
//! were missed, and nothing for records that did not change: a watch never loses or
//! duplicates an instance across a gap.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::record::decode_record;
use super::{EndpointId, Instance};
use crate::advert::ModelCard;
use crate::hooks::Seam;

/// A change in the store, as a backend reports it. Keys are relative to the backend's root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RawEvent {
    /// The complete current contents under the watched prefix.
    Resync(Vec<(String, Vec<u8>)>),
    /// A record was written (created or overwritten).
    Put(String, Vec<u8>),
    /// A record was deleted or expired.
    Delete(String),
}

/// Which records a watcher cares about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Every record of a namespace.
    Namespace(String),
    /// Every record of one endpoint.
    Endpoint(EndpointId),
}

impl Scope {
    fn contains(&self, instance: &Instance) -> bool {
        match self {
            Scope::Namespace(ns) => instance.endpoint.namespace == *ns,
            Scope::Endpoint(ep) => instance.endpoint == *ep,
        }
    }
}

/// What a watcher learns from one raw event.
#[derive(Clone, Debug, PartialEq)]
#[allow(clippy::large_enum_variant)] // one short-lived value per discovery change, not stored
pub(crate) enum Change {
    /// A record appeared or changed; `previous` is the instance known before, if any.
    Upserted {
        previous: Option<Instance>,
        instance: Instance,
        card: ModelCard,
    },
    /// A known record is gone (deleted, expired, or no longer readable).
    Removed(Instance),
}

/// A deliberate mutant of the known set (see `crate::hooks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KnownMutant {
    /// A resync replaces the known set without diffing it (the resync test must catch it).
    BlindResync,
}

/// The records a watcher knows, keyed by store key.
#[derive(Debug)]
pub(crate) struct KnownSet {
    scope: Scope,
    records: BTreeMap<String, (Instance, ModelCard)>,
    /// Keys already reported as malformed: warn once per bad record, not once per resync.
    malformed: BTreeSet<String>,
    /// Where the blind-resync mutant breaks resyncs; zero-sized in normal builds.
    mutant: Seam<KnownMutant>,
}

impl KnownSet {
    pub(crate) fn new(scope: Scope) -> Self {
        KnownSet {
            scope,
            records: BTreeMap::new(),
            malformed: BTreeSet::new(),
            mutant: Seam::off(),
        }
    }

    /// The set running a deliberate mutant.
    #[cfg(test)]
    pub(crate) fn with_mutant(mut self, mutant: KnownMutant) -> Self {
        self.mutant = Seam::on(mutant);
        self
    }

    /// Number of records known.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.records.len()
    }

    /// Read one record; `None` (with a warning the first time) if unreadable or out of scope.
    fn read(&mut self, key: &str, bytes: &[u8]) -> Option<(Instance, ModelCard)> {
        match decode_record(key, bytes) {
            Ok((instance, card)) => {
                self.malformed.remove(key);
                self.scope.contains(&instance).then_some((instance, card))
            }
            Err(error) => {
                if self.malformed.insert(key.to_owned()) {
                    tracing::warn!(key, %error, "skipping malformed discovery record");
                }
                None
            }
        }
    }

    /// Apply one raw event, appending what changed to `out` (removals before upserts).
    pub(crate) fn apply(&mut self, event: RawEvent, out: &mut VecDeque<Change>) {
        match event {
            RawEvent::Put(key, bytes) => match self.read(&key, &bytes) {
                Some(record) => self.upsert(key, record, out),
                // Unreadable now: whatever it was, it is no longer a live instance.
                None => self.remove(&key, out),
            },
            RawEvent::Delete(key) => {
                self.malformed.remove(&key);
                self.remove(&key, out);
            }
            RawEvent::Resync(listing) => {
                let mut fresh = BTreeMap::new();
                let mut seen = BTreeSet::new();
                for (key, bytes) in listing {
                    seen.insert(key.clone());
                    if let Some(record) = self.read(&key, &bytes) {
                        fresh.insert(key, record);
                    }
                }
                self.malformed.retain(|key| seen.contains(key));
                if self.mutant.is(KnownMutant::BlindResync) {
                    self.records.clear();
                }
                let gone: Vec<String> = self
                    .records
                    .keys()
                    .filter(|key| !fresh.contains_key(*key))
                    .cloned()
                    .collect();
                for key in gone {
                    self.remove(&key, out);
                }
                for (key, record) in fresh {
                    self.upsert(key, record, out);
                }
            }
        }
    }

    fn upsert(&mut self, key: String, record: (Instance, ModelCard), out: &mut VecDeque<Change>) {
        let previous = match self.records.get(&key) {
            Some(known) if *known == record => return,
            Some((instance, _)) => Some(instance.clone()),
            None => None,
        };
        out.push_back(Change::Upserted {
            previous,
            instance: record.0.clone(),
            card: record.1.clone(),
        });
        self.records.insert(key, record);
    }

    fn remove(&mut self, key: &str, out: &mut VecDeque<Change>) {
        if let Some((instance, _)) = self.records.remove(key) {
            out.push_back(Change::Removed(instance));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::record::{encode_record, record_key};
    use super::*;

    fn inst(id: u64, port: u16) -> Instance {
        Instance {
            endpoint: EndpointId::new("ns", "prefill", "generate"),
            instance_id: id,
            address: format!("127.0.0.1:{port}").parse().unwrap(),
        }
    }

    fn put(i: &Instance, card: &str) -> (String, Vec<u8>) {
        (
            record_key(&i.endpoint, i.instance_id),
            encode_record(i, &ModelCard::named(card)),
        )
    }

    fn run(known: &mut KnownSet, event: RawEvent) -> Vec<Change> {
        let mut out = VecDeque::new();
        known.apply(event, &mut out);
        out.into()
    }

    fn scope() -> Scope {
        Scope::Endpoint(EndpointId::new("ns", "prefill", "generate"))
    }

    #[test]
    fn resync_emits_only_what_changed() {
        check_resync_emits_only_what_changed(KnownSet::new(scope()));
    }

    #[test]
    fn blind_resync_mutant_is_caught() {
        let mutant = KnownSet::new(scope()).with_mutant(KnownMutant::BlindResync);
        let caught = std::panic::catch_unwind(move || check_resync_emits_only_what_changed(mutant));
        assert!(caught.is_err(), "a non-diffing resync went unnoticed");
    }

    fn check_resync_emits_only_what_changed(mut known: KnownSet) {
        let (a, b, c) = (inst(1, 1), inst(2, 2), inst(3, 3));
        let first = run(
            &mut known,
            RawEvent::Resync(vec![put(&a, "m"), put(&b, "m")]),
        );
        assert_eq!(first.len(), 2);
        // b gone, c new, a unchanged: exactly one removal then one upsert.
        let second = run(
            &mut known,
            RawEvent::Resync(vec![put(&a, "m"), put(&c, "m")]),
        );
        assert_eq!(
            second,
            vec![
                Change::Removed(b),
                Change::Upserted {
                    previous: None,
                    instance: c,
                    card: ModelCard::named("m")
                }
            ]
        );
        assert_eq!(known.len(), 2);
    }

    #[test]
    fn repeated_put_of_the_same_record_is_silent() {
        let mut known = KnownSet::new(scope());
        let a = inst(1, 1);
        let (k, v) = put(&a, "m");
        assert_eq!(
            run(&mut known, RawEvent::Put(k.clone(), v.clone())).len(),
            1
        );
        assert!(run(&mut known, RawEvent::Put(k, v)).is_empty());
    }

    #[test]
    fn card_change_is_an_upsert_with_the_previous_instance() {
        let mut known = KnownSet::new(scope());
        let a = inst(1, 1);
        let (k, v) = put(&a, "m1");
        run(&mut known, RawEvent::Put(k, v));
        let (k, v) = put(&a, "m2");
        let out = run(&mut known, RawEvent::Put(k, v));
        assert_eq!(
            out,
            vec![Change::Upserted {
                previous: Some(a.clone()),
                instance: a,
                card: ModelCard::named("m2")
            }]
        );
    }

    #[test]
    fn malformed_records_are_skipped_and_a_corrupted_known_one_is_removed() {
        let mut known = KnownSet::new(scope());
        let a = inst(1, 1);
        let (k, v) = put(&a, "m");
        let out = run(
            &mut known,
            RawEvent::Resync(vec![
                ("junk".into(), b"{".to_vec()),
                (k.clone(), v),
                (record_key(&a.endpoint, 2), b"[]".to_vec()),
            ]),
        );
        assert_eq!(out.len(), 1);
        let out = run(&mut known, RawEvent::Put(k, b"garbage".to_vec()));
        assert_eq!(out, vec![Change::Removed(a)]);
        assert_eq!(known.len(), 0);
    }

    #[test]
    fn out_of_scope_records_are_ignored() {
        let mut known = KnownSet::new(scope());
        let other = Instance {
            endpoint: EndpointId::new("ns", "decode", "generate"),
            ..inst(1, 1)
        };
        let (k, v) = put(&other, "m");
        assert!(run(&mut known, RawEvent::Put(k, v)).is_empty());
        let mut ns = KnownSet::new(Scope::Namespace("ns".into()));
        let (k, v) = put(&other, "m");
        assert_eq!(run(&mut ns, RawEvent::Put(k, v)).len(), 1);
    }

    #[test]
    fn delete_of_an_unknown_key_is_silent() {
        let mut known = KnownSet::new(scope());
        assert!(run(&mut known, RawEvent::Delete("nope".into())).is_empty());
    }

    mod level_triggered {
        use super::*;
        use proptest::prelude::*;

        /// One change to the store, and whether the watcher hears about it.
        #[derive(Clone, Debug)]
        enum Op {
            /// Write instance `id` at `port` with card `card`; `heard` false = lost event.
            Write {
                id: u64,
                port: u16,
                card: u8,
                heard: bool,
            },
            /// Write junk under instance `id`'s key.
            Corrupt { id: u64, heard: bool },
            /// Delete instance `id`.
            Delete { id: u64, heard: bool },
            /// A gap heals: the watcher gets a full listing.
            Resync,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0..6u64, 1..3u16, 0..2u8, proptest::bool::weighted(0.8))
                    .prop_map(|(id, port, card, heard)| Op::Write { id, port, card, heard }),
                1 => (0..6u64, proptest::bool::weighted(0.8))
                    .prop_map(|(id, heard)| Op::Corrupt { id, heard }),
                2 => (0..6u64, proptest::bool::weighted(0.8))
                    .prop_map(|(id, heard)| Op::Delete { id, heard }),
                1 => Just(Op::Resync),
            ]
        }

        proptest! {
            /// Whatever events are lost, after a resync the watcher's view, built only from
            /// the changes it was given, equals the readable contents of the store; and no
            /// change it was given was a no-op (a duplicate upsert or a removal of nothing).
            #[test]
            fn view_converges_to_the_store_after_every_resync(ops in proptest::collection::vec(op(), 1..60)) {
                let mut store: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                let mut known = KnownSet::new(scope());
                let mut view: BTreeMap<u64, (Instance, ModelCard)> = BTreeMap::new();
                let mut out = VecDeque::new();
                for op in ops {
                    let event = match op {
                        Op::Write { id, port, card, heard } => {
                            let (k, v) = put(&inst(id, port), &format!("m{card}"));
                            store.insert(k.clone(), v.clone());
                            heard.then_some(RawEvent::Put(k, v))
                        }
                        Op::Corrupt { id, heard } => {
                            let k = record_key(&inst(id, 1).endpoint, id);
                            store.insert(k.clone(), b"{oops".to_vec());
                            heard.then_some(RawEvent::Put(k, b"{oops".to_vec()))
                        }
                        Op::Delete { id, heard } => {
                            let k = record_key(&inst(id, 1).endpoint, id);
                            store.remove(&k);
                            heard.then_some(RawEvent::Delete(k))
                        }
                        Op::Resync => Some(RawEvent::Resync(
                            store.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                        )),
                    };
                    let resync = matches!(event, Some(RawEvent::Resync(_)));
                    if let Some(event) = event {
                        known.apply(event, &mut out);
                    }
                    for change in out.drain(..) {
                        match change {
                            Change::Upserted { previous, instance, card } => {
                                let before = view.insert(instance.instance_id, (instance.clone(), card.clone()));
                                prop_assert_eq!(before.as_ref().map(|(i, _)| i.clone()), previous);
                                prop_assert_ne!(before, Some((instance, card)), "no-op upsert");
                            }
                            Change::Removed(instance) => {
                                prop_assert!(view.remove(&instance.instance_id).is_some(), "removal of nothing");
                            }
                        }
                    }
                    if resync {
                        let readable: BTreeMap<u64, (Instance, ModelCard)> = store
                            .iter()
                            .filter_map(|(k, v)| decode_record(k, v).ok())
                            .map(|(i, c)| (i.instance_id, (i, c)))
                            .collect();
                        prop_assert_eq!(&view, &readable);
                    }
                }
            }
        }
    }
}
