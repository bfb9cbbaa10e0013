//! Helpers shared by the cases: names, records, waiting on streams, and the watchers'
//! beliefs built only from their events.

use super::*;

pub(crate) fn endpoint(ns: &str, component: &str) -> EndpointId {
    EndpointId::new(ns, component, "generate")
}

pub(crate) fn instance(endpoint: &EndpointId, id: InstanceId) -> Instance {
    Instance {
        endpoint: endpoint.clone(),
        instance_id: id,
        address: SocketAddr::from(([127, 0, 0, 1], 20_000 + (id % 10_000) as u16)),
    }
}

pub(crate) fn card(name: &str, mode: SelectionMode) -> ModelCard {
    ModelCard::routed(name, mode, 16)
}

pub(crate) async fn next<S: Stream + Unpin>(stream: &mut S) -> S::Item {
    match tokio::time::timeout(EVENT_WAIT, stream.next()).await {
        Ok(Some(item)) => item,
        Ok(None) => panic!("watch ended"),
        Err(_) => panic!("no event within {EVENT_WAIT:?}"),
    }
}

/// Asserts the stream stays silent for `QUIET`.
pub(crate) async fn assert_quiet<S: Stream + Unpin>(stream: &mut S)
where
    S::Item: std::fmt::Debug,
{
    if let Ok(item) = tokio::time::timeout(QUIET, stream.next()).await {
        panic!("unexpected watch event: {item:?}");
    }
}

/// What an endpoint watcher believes, built only from its events. Rejects duplicates (an
/// `Added` of an instance already known unchanged) and removals of unknown instances.
#[derive(Debug, Default)]
pub(crate) struct View {
    pub(crate) instances: BTreeMap<InstanceId, Instance>,
    pub(crate) removals: usize,
}

impl View {
    pub(crate) fn apply(&mut self, event: InstanceEvent) {
        match event {
            InstanceEvent::Added(instance) => {
                let previous = self
                    .instances
                    .insert(instance.instance_id, instance.clone());
                assert_ne!(previous, Some(instance), "duplicate Added");
            }
            InstanceEvent::Removed(id) => {
                assert!(
                    self.instances.remove(&id).is_some(),
                    "Removed of unknown {id}"
                );
                self.removals += 1;
            }
        }
    }

    pub(crate) fn is(&self, expected: &[&Instance]) -> bool {
        self.instances.len() == expected.len()
            && expected
                .iter()
                .all(|i| self.instances.get(&i.instance_id) == Some(*i))
    }

    /// Apply events until the view holds exactly `expected`.
    pub(crate) async fn until(&mut self, stream: &mut InstanceStream, expected: &[&Instance]) {
        while !self.is(expected) {
            self.apply(next(stream).await);
        }
    }
}

/// A namespace watcher's belief.
#[derive(Debug, Default)]
pub(crate) struct NsView {
    pub(crate) records: BTreeMap<(EndpointId, InstanceId), (Instance, ModelCard)>,
}

impl NsView {
    pub(crate) fn apply(&mut self, event: NamespaceEvent) {
        match event {
            NamespaceEvent::Upserted(instance, card) => {
                let key = (instance.endpoint.clone(), instance.instance_id);
                let record = (instance, card);
                let previous = self.records.insert(key, record.clone());
                assert_ne!(previous, Some(record), "duplicate Upserted");
            }
            NamespaceEvent::Removed(endpoint, id) => {
                assert!(
                    self.records.remove(&(endpoint, id)).is_some(),
                    "Removed of unknown {id}"
                );
            }
        }
    }

    pub(crate) async fn until(
        &mut self,
        stream: &mut NamespaceStream,
        expected: &[(&Instance, &ModelCard)],
    ) {
        loop {
            let matches = self.records.len() == expected.len()
                && expected.iter().all(|(i, c)| {
                    self.records.get(&(i.endpoint.clone(), i.instance_id))
                        == Some(&((*i).clone(), (*c).clone()))
                });
            if matches {
                return;
            }
            self.apply(next(stream).await);
        }
    }
}
