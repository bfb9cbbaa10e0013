//! TLS on the request plane (feature `tls`): rustls with the ring provider.
//!
//! A worker serves with a [`ServerTls`] (its certificate chain and key; with client roots it
//! requires a client certificate that chains to them: mutual TLS). A frontend connects with a
//! [`ClientTls`] (the roots the worker's certificate must chain to; with an identity it
//! presents a client certificate). Workers are addressed by IP (discovery carries a socket
//! address), so by default the client checks the worker's certificate for an IP address SAN
//! equal to the address it dialled; [`ClientTls::with_server_name`] checks a DNS name instead.
//! See docs/transport.md ("TLS") for what this does and does not protect against.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;

use super::error::TransportError;

/// The default bound on a server-side handshake (see [`ServerTls::with_handshake_timeout`]).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A certificate or key file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The PEM data is malformed (a section without its end, bad base64, ...).
    #[error("malformed PEM in {what}: {reason}")]
    Pem {
        /// Where the PEM came from (a path, or "PEM data").
        what: String,
        /// What the parser rejected.
        reason: String,
    },
    /// No `CERTIFICATE` section where one or more were expected.
    #[error("no certificate found in {what}")]
    NoCertificate {
        /// Where the PEM came from.
        what: String,
    },
    /// No private key (PKCS#8, PKCS#1 or SEC1) where one was expected.
    #[error("no private key found in {what}")]
    NoKey {
        /// Where the PEM came from.
        what: String,
    },
    /// A CA certificate that cannot serve as a trust root.
    #[error("unusable CA certificate: {reason}")]
    BadCa {
        /// rustls' reason.
        reason: String,
    },
    /// rustls refused the certificate and key (an unsupported key type, a key that does not
    /// match the certificate, ...).
    #[error("certificate and key rejected: {reason}")]
    BadIdentity {
        /// rustls' reason.
        reason: String,
    },
    /// The server name to verify is neither a valid DNS name nor an IP address.
    #[error("invalid TLS server name `{name}`")]
    ServerName {
        /// The name given.
        name: String,
    },
}

fn pem_error(what: &str, error: rustls_pki_types::pem::Error) -> TlsError {
    TlsError::Pem {
        what: what.to_owned(),
        reason: error.to_string(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(what, e))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            what: what.to_owned(),
        });
    }
    Ok(chain)
}

fn private_key(pem: &[u8], what: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    match PrivateKeyDer::from_pem_slice(pem) {
        Ok(key) => Ok(key),
        Err(rustls_pki_types::pem::Error::NoItemsFound) => Err(TlsError::NoKey {
            what: what.to_owned(),
        }),
        Err(e) => Err(pem_error(what, e)),
    }
}

/// The provider every configuration here is built with: ring, named explicitly rather than
/// taken from the process default, so another crate installing a different default cannot
/// change (or break, by installing two) what the request plane uses.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A certificate chain (leaf first) and its private key: a worker's server identity, or a
/// frontend's client identity for mutual TLS.
pub struct TlsIdentity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl TlsIdentity {
    /// From PEM files: `cert` holds the chain (leaf first), `key` the private key.
    pub fn from_pem_files(cert: impl AsRef<Path>, key: impl AsRef<Path>) -> Result<Self, TlsError> {
        let (cert, key) = (cert.as_ref(), key.as_ref());
        Ok(TlsIdentity {
            chain: certificates(&read(cert)?, &cert.display().to_string())?,
            key: private_key(&read(key)?, &key.display().to_string())?,
        })
    }

    /// From PEM in memory.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Self, TlsError> {
        Ok(TlsIdentity {
            chain: certificates(cert_pem, "certificate PEM data")?,
            key: private_key(key_pem, "key PEM data")?,
        })
    }

    /// From DER: `chain` leaf first (at least one certificate).
    pub fn from_der(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<Self, TlsError> {
        if chain.is_empty() {
            return Err(TlsError::NoCertificate {
                what: "the DER chain".into(),
            });
        }
        Ok(TlsIdentity { chain, key })
    }

    fn parts(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        (self.chain.clone(), self.key.clone_key())
    }
}

impl Clone for TlsIdentity {
    fn clone(&self) -> Self {
        let (chain, key) = self.parts();
        TlsIdentity { chain, key }
    }
}

impl fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key.
        f.debug_struct("TlsIdentity")
            .field("certificates", &self.chain.len())
            .finish_non_exhaustive()
    }
}

/// The CA certificates a peer's certificate must chain to.
#[derive(Clone, Debug)]
pub struct TlsRoots {
    store: Arc<RootCertStore>,
}

impl TlsRoots {
    /// From a PEM file of one or more CA certificates.
    pub fn from_pem_file(path: impl AsRef<Path>) -> Result<Self, TlsError> {
        let path = path.as_ref();
        Self::from_der(certificates(&read(path)?, &path.display().to_string())?)
    }

    /// From PEM in memory.
    pub fn from_pem(pem: &[u8]) -> Result<Self, TlsError> {
        Self::from_der(certificates(pem, "CA PEM data")?)
    }

    /// From DER certificates (at least one).
    pub fn from_der(certs: Vec<CertificateDer<'static>>) -> Result<Self, TlsError> {
        if certs.is_empty() {
            return Err(TlsError::NoCertificate {
                what: "the CA list".into(),
            });
        }
        let mut store = RootCertStore::empty();
        for cert in certs {
            store.add(cert).map_err(|e| TlsError::BadCa {
                reason: e.to_string(),
            })?;
        }
        Ok(TlsRoots {
            store: Arc::new(store),
        })
    }
}

/// A worker's TLS: put it in [`ServerConfig::tls`](super::ServerConfig::tls).
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<rustls::ServerConfig>,
    handshake_timeout: Duration,
    mutual: bool,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("mutual", &self.mutual)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Server authentication only: any client that completes the handshake may send requests.
    pub fn new(identity: TlsIdentity) -> Result<Self, TlsError> {
        let (chain, key) = identity.parts();
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(bad_identity)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(bad_identity)?;
        Ok(Self::from_rustls(Arc::new(config), false))
    }

    /// Mutual TLS: a client must present a certificate that chains to `client_roots` (and is
    /// within its validity period), else the handshake fails and the connection is closed
    /// before any request is read.
    pub fn mutual(identity: TlsIdentity, client_roots: TlsRoots) -> Result<Self, TlsError> {
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            client_roots.store,
            provider(),
        )
        .build()
        .map_err(|e| TlsError::BadCa {
            reason: e.to_string(),
        })?;
        let (chain, key) = identity.parts();
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(bad_identity)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(bad_identity)?;
        Ok(Self::from_rustls(Arc::new(config), true))
    }

    /// A rustls configuration built elsewhere (custom verifiers, certificate reloading);
    /// `mutual` is only reported by [`requires_client_cert`](Self::requires_client_cert).
    pub fn from_rustls(config: Arc<rustls::ServerConfig>, mutual: bool) -> Self {
        ServerTls {
            config,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            mutual,
        }
    }

    /// How long a connection may take to complete its handshake (default
    /// [`DEFAULT_HANDSHAKE_TIMEOUT`]); past it the connection is closed, so a client that
    /// stalls mid-handshake holds a connection slot no longer than this.
    #[must_use]
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Whether clients must present a certificate (mutual TLS).
    pub fn requires_client_cert(&self) -> bool {
        self.mutual
    }

    /// The handshake bound.
    pub fn handshake_timeout(&self) -> Duration {
        self.handshake_timeout
    }

    /// Run the server side of the handshake on an accepted connection, within the handshake
    /// timeout.
    pub(crate) async fn accept(
        &self,
        stream: TcpStream,
    ) -> Result<tokio_rustls::server::TlsStream<TcpStream>, String> {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(&self.config));
        match tokio::time::timeout(self.handshake_timeout, acceptor.accept(stream)).await {
            Err(_) => Err(format!(
                "handshake not finished within {:?}",
                self.handshake_timeout
            )),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(stream)) => Ok(stream),
        }
    }
}

fn bad_identity(e: rustls::Error) -> TlsError {
    TlsError::BadIdentity {
        reason: e.to_string(),
    }
}

/// A frontend's TLS: put it in [`ClientConfig::tls`](super::ClientConfig::tls).
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
    /// The name to verify; `None`: the IP address dialled.
    server_name: Option<ServerName<'static>>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .field(
                "client_cert",
                &self.config.client_auth_cert_resolver.has_certs(),
            )
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Verify workers against `roots`; present no client certificate.
    pub fn new(roots: TlsRoots) -> Result<Self, TlsError> {
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(bad_identity)?
            .with_root_certificates(roots.store)
            .with_no_client_auth();
        Ok(Self::from_rustls(Arc::new(config)))
    }

    /// Verify workers against `roots`, and present `identity` to workers that ask for a client
    /// certificate (mutual TLS).
    pub fn mutual(roots: TlsRoots, identity: TlsIdentity) -> Result<Self, TlsError> {
        let (chain, key) = identity.parts();
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(bad_identity)?
            .with_root_certificates(roots.store)
            .with_client_auth_cert(chain, key)
            .map_err(bad_identity)?;
        Ok(Self::from_rustls(Arc::new(config)))
    }

    /// A rustls configuration built elsewhere.
    pub fn from_rustls(config: Arc<rustls::ClientConfig>) -> Self {
        ClientTls {
            config,
            server_name: None,
        }
    }

    /// Check every worker's certificate for `name` (a DNS name, or an IP address) instead of
    /// the IP address dialled: for certificates issued to a name the whole pool shares.
    pub fn with_server_name(mut self, name: &str) -> Result<Self, TlsError> {
        let parsed = ServerName::try_from(name.to_owned()).map_err(|_| TlsError::ServerName {
            name: name.to_owned(),
        })?;
        self.server_name = Some(parsed);
        Ok(self)
    }

    /// Run the client side of the handshake within `timeout`. A failure is
    /// [`TransportError::Tls`], which the dispatchers treat like a refused connection.
    pub(crate) async fn connect(
        &self,
        stream: TcpStream,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, TransportError> {
        let name = self
            .server_name
            .clone()
            .unwrap_or_else(|| ServerName::IpAddress(addr.ip().into()));
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&self.config));
        match tokio::time::timeout(timeout, connector.connect(name, stream)).await {
            Err(_) => Err(TransportError::Tls {
                addr,
                reason: format!("handshake not finished within {timeout:?}"),
            }),
            Ok(Err(e)) => Err(TransportError::Tls {
                addr,
                reason: e.to_string(),
            }),
            Ok(Ok(stream)) => Ok(stream),
        }
    }
}

/// Whether a read error came from TLS (an alert from the peer, a bad record): with TLS 1.3 a
/// server's refusal of the client's certificate arrives after the client finished its side
/// of the handshake, as such an error on the first read.
pub(crate) fn is_tls_error(error: &io::Error) -> bool {
    error
        .get_ref()
        .is_some_and(|inner| inner.is::<rustls::Error>())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The client's read loop reports a TLS alert (a mutual-TLS refusal) as
    /// [`TransportError::Tls`] only if this recognises it, and other I/O errors stay
    /// `Disconnected`.
    #[test]
    fn tls_read_errors_are_told_from_other_io_errors() {
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired);
        // tokio-rustls wraps rustls errors this way.
        assert!(is_tls_error(&io::Error::new(
            io::ErrorKind::InvalidData,
            alert
        )));
        assert!(!is_tls_error(&io::Error::from(
            io::ErrorKind::ConnectionReset
        )));
        assert!(!is_tls_error(&io::Error::new(
            io::ErrorKind::InvalidData,
            "some other payload"
        )));
    }
}
