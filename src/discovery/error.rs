//! Typed errors of the discovery layer.

/// Why a discovery operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The instance cannot be registered as given (e.g. an empty namespace).
    #[error("invalid instance: {0}")]
    InvalidInstance(String),
    /// A file-store operation failed.
    #[error("discovery store I/O failed while {context}: {source}")]
    Io {
        /// What the store was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file-store watcher (inotify) could not be set up.
    #[error("cannot watch the discovery directory: {0}")]
    Watch(String),
    /// The etcd server refused or could not be reached.
    #[error("etcd: {0}")]
    Etcd(String),
    /// The Kubernetes API server refused, failed or could not be reached.
    #[error("kubernetes: {0}")]
    Kubernetes(String),
    /// This backend cannot publish a record: its workers are published another way (on
    /// Kubernetes, by being a ready pod with a card annotation).
    #[error("this discovery backend cannot register instances: {0}")]
    RegisterUnsupported(&'static str),
    /// The background task serving this operation has stopped (runtime shutting down).
    #[error("discovery background task stopped")]
    Closed,
}

impl DiscoveryError {
    #[cfg_attr(not(feature = "runtime"), allow(dead_code))]
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        DiscoveryError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Why one stored record could not be read (the record is skipped, never fatal).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The bytes are not a record document (bad JSON, or a bad instance or card inside).
    #[error("unreadable record: {0}")]
    Malformed(#[from] serde_json::Error),
    /// The record describes another instance than the key it is stored under.
    #[error("record stored under {key:?} describes the instance of key {expected:?}")]
    KeyMismatch {
        /// Where the record was found.
        key: String,
        /// The key its content belongs under.
        expected: String,
    },
}
