//! The checking driver of the topology machine: admission sets and the target held as plain
//! values, each batch carried out in order and checked as it goes, the state checked after
//! every event. One source for two includers: the machine's unit tests (`mod checker`, under
//! `cfg(test)`) and the fuzz harness (`testkit/src/topology_fuzz.rs` includes this file with
//! `#[path]`), because the library's unit tests cannot call the testkit, which links its own
//! copy of the library. The file names what it uses through `super::*`: each includer imports
//! the machine's types under the same names.
//!
//! The checks: the target held admits at least one instance at every point of a batch (grows
//! before `SetTarget`, shrinks after); `grows` is true exactly for supersets and an admission
//! change changes the set; a `SetTarget` changes the target; a generation is fresh when first
//! named (strictly above every earlier one of its set, forgotten sets included) and never named
//! after its `Retire` or `Forget`; after the event the held target is the machine's, admits
//! exactly the live instances carrying its card, and exists exactly when one prefill set admits
//! someone and one decode set is live; dormant sets stay within `MAX_DORMANT_SETS` and the
//! driver keeps no more admission sets than the machine remembers sets.

use super::*;

/// The driver's state: what it holds and what discovery reported.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Admission sets of generations named and not retired or forgotten.
    pub admissions: BTreeMap<GenerationId, BTreeSet<InstanceId>>,
    /// The target the driver holds.
    pub target: Option<TargetSpec>,
    /// Generations retired or forgotten: never named again.
    dead: BTreeSet<GenerationId>,
    /// Highest generation named per set (remembered across evictions: never reused).
    highest: BTreeMap<EndpointId, u64>,
    /// Live worker instances as discovery reported them.
    live: BTreeMap<(EndpointId, InstanceId), ModelCard>,
}

/// What the state check reads of the machine under test.
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    /// The target the machine last ordered.
    pub target: Option<&'a TargetSpec>,
    /// Sets it remembers.
    pub set_count: usize,
    /// Dormant sets it remembers.
    pub dormant_count: usize,
}

impl Ledger {
    /// Note what discovery reports, before the machine sees `event`.
    pub fn observe(&mut self, event: &NamespaceEvent) {
        match event {
            NamespaceEvent::Upserted(i, c) => {
                if worker_kind(&i.endpoint).is_some() {
                    self.live
                        .insert((i.endpoint.clone(), i.instance_id), c.clone());
                }
            }
            NamespaceEvent::Removed(e, id) => {
                self.live.remove(&(e.clone(), *id));
            }
        }
    }

    fn name(&mut self, id: &GenerationId) -> Result<(), String> {
        if self.dead.contains(id) {
            return Err(format!("{id} named after it was retired or forgotten"));
        }
        if !self.admissions.contains_key(id) {
            let highest = self.highest.entry(id.endpoint.clone()).or_default();
            if id.generation <= *highest {
                return Err(format!("{id} reuses a generation (highest {highest})"));
            }
            *highest = id.generation;
            self.admissions.insert(id.clone(), BTreeSet::new());
        }
        Ok(())
    }

    /// Carry out one batch in order, checking each action; `Err` names the first broken rule.
    pub fn carry_out(&mut self, actions: &[Action]) -> Result<(), String> {
        for (n, action) in actions.iter().enumerate() {
            match action {
                Action::Admission { id, set, grows } => {
                    self.name(id)?;
                    let before = &self.admissions[id];
                    if *grows != set.is_superset(before) {
                        return Err(format!("{action:?}: grows is wrong (was {before:?})"));
                    }
                    if set == before {
                        return Err(format!("{action:?}: publishes no change"));
                    }
                    self.admissions.insert(id.clone(), set.clone());
                }
                Action::SetTarget(spec) => {
                    if spec.as_ref().map(|t| &t.id) == self.target.as_ref().map(|t| &t.id) {
                        return Err(format!("{action:?}: the target did not change"));
                    }
                    if let Some(t) = spec {
                        self.name(&t.id)?;
                    }
                    self.target = spec.clone();
                }
                Action::Retire(id) | Action::Forget(id) => {
                    if self.admissions.remove(id).is_none() {
                        return Err(format!("{action:?}: not a live generation"));
                    }
                    if self.target.as_ref().is_some_and(|t| t.id == *id) {
                        return Err(format!("{action:?}: the held target's generation"));
                    }
                    self.dead.insert(id.clone());
                }
            }
            // The ordering rule: the target held admits someone at every point of a batch.
            if let Some(t) = &self.target {
                if self.admissions.get(&t.id).is_none_or(BTreeSet::is_empty) {
                    return Err(format!(
                        "after action {n} of {actions:?}: the target {} admits no instance",
                        t.id
                    ));
                }
            }
        }
        Ok(())
    }

    /// The invariants between events, against what the machine reports.
    pub fn check_state(&self, machine: Observed<'_>) -> Result<(), String> {
        if self.target.as_ref() != machine.target {
            return Err(format!(
                "holds {:?}, machine says {:?}",
                self.target, machine.target
            ));
        }
        // Every instance admitted for the target carries its card, and every live one that
        // carries it is admitted.
        if let Some(t) = &self.target {
            let want: BTreeSet<InstanceId> = self
                .live
                .iter()
                .filter(|((e, _), c)| *e == t.id.endpoint && **c == *t.card)
                .map(|((_, id), _)| *id)
                .collect();
            if self.admissions[&t.id] != want {
                return Err(format!(
                    "{} admits {:?}, live with its card {want:?}",
                    t.id, self.admissions[&t.id]
                ));
            }
        }
        // A target exactly when one prefill set admits someone and one decode set is live.
        let prefill: BTreeSet<&EndpointId> = self
            .admissions
            .iter()
            .filter(|(_, set)| !set.is_empty())
            .map(|(id, _)| &id.endpoint)
            .collect();
        let decode: BTreeSet<&EndpointId> = self
            .live
            .keys()
            .map(|(e, _)| e)
            .filter(|e| worker_kind(e) == Some(WorkerKind::Decode))
            .collect();
        if self.target.is_some() != (prefill.len() == 1 && decode.len() == 1) {
            return Err(format!(
                "target {:?} with prefill sets {prefill:?}, decode sets {decode:?}",
                self.target
            ));
        }
        // Bounded memory: dormant sets capped, one admission set per remembered prefill set.
        if machine.dormant_count > MAX_DORMANT_SETS {
            return Err(format!("{} dormant sets", machine.dormant_count));
        }
        if self.admissions.len() > machine.set_count {
            return Err(format!(
                "{} admission sets for {} sets",
                self.admissions.len(),
                machine.set_count
            ));
        }
        Ok(())
    }
}
