//! How a worker set's type is known: from its component name.

use crate::discovery::EndpointId;

/// The role of a worker set in disaggregated serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerKind {
    /// Prefill workers: the hop this crate routes.
    Prefill,
    /// Decode workers: the consumers of the prefill hop.
    Decode,
}

/// The role of the worker set serving `endpoint`, from its component name: `prefill` or a name
/// starting with `prefill-` / `prefill_` is a prefill set; `decode`, `decode-*`, `decode_*` a
/// decode set; any other component is not part of the prefill/decode topology (`None`).
///
/// Why the component name and not a field of the card: the card is what workers advertise
/// about *routing* (and what first-wins admission compares), and the role is already how
/// deployments name components (`dynamo/prefill/generate`, `dynamo/decode/generate`); a card
/// field would make an old card without it ambiguous.
pub fn worker_kind(endpoint: &EndpointId) -> Option<WorkerKind> {
    let name = endpoint.component.as_str();
    let is = |prefix: &str| {
        name == prefix
            || name
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with('-') || rest.starts_with('_'))
    };
    if is("prefill") {
        Some(WorkerKind::Prefill)
    } else if is("decode") {
        Some(WorkerKind::Decode)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(component: &str) -> Option<WorkerKind> {
        worker_kind(&EndpointId::new("ns", component, "generate"))
    }

    #[test]
    fn component_names_decide_the_worker_kind() {
        assert_eq!(kind("prefill"), Some(WorkerKind::Prefill));
        assert_eq!(kind("prefill-blue"), Some(WorkerKind::Prefill));
        assert_eq!(kind("prefill_v2"), Some(WorkerKind::Prefill));
        assert_eq!(kind("decode"), Some(WorkerKind::Decode));
        assert_eq!(kind("decode-a"), Some(WorkerKind::Decode));
        assert_eq!(kind("prefiller"), None);
        assert_eq!(kind("encoder"), None);
        assert_eq!(kind(""), None);
    }
}
