//! The request plane's TLS flags, shared by `worker` (server side) and `serve` (client side).

use std::path::PathBuf;

use prefill_router::transport::{ClientTls, ServerTls, TlsIdentity, TlsRoots};

use crate::args::{CliError, Flags};

/// `--tls-*` flags as given; checked for consistency by [`TlsFlags::server`] and
/// [`TlsFlags::client`] at parse time, and the files read when the command starts (so a
/// rotated file is picked up by a restart, and a missing one fails the start, not the parse).
#[derive(Clone, Debug, Default)]
pub struct TlsFlags {
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    /// `--tls-ca` (serve: the workers' CA) or `--tls-client-ca` (worker: the frontends' CA).
    ca: Option<PathBuf>,
    server_name: Option<String>,
}

impl TlsFlags {
    /// Take `flag` if it is one of the TLS flags of a `worker` (`client_side` false) or a
    /// `serve` (true); false if it is not.
    pub fn take(
        &mut self,
        flag: &str,
        flags: &mut Flags<'_>,
        client_side: bool,
    ) -> Result<bool, CliError> {
        match (flag, client_side) {
            ("--tls-cert", _) => self.cert = Some(flags.value(flag)?.into()),
            ("--tls-key", _) => self.key = Some(flags.value(flag)?.into()),
            ("--tls-client-ca", false) | ("--tls-ca", true) => {
                self.ca = Some(flags.value(flag)?.into())
            }
            ("--tls-server-name", true) => self.server_name = Some(flags.value(flag)?.to_owned()),
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn identity(&self) -> Result<Option<(&PathBuf, &PathBuf)>, CliError> {
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Ok(Some((cert, key))),
            (None, None) => Ok(None),
            _ => Err(CliError::Usage(
                "--tls-cert and --tls-key go together".into(),
            )),
        }
    }

    /// Check a worker's flags: a client CA needs the worker's own certificate.
    pub fn check_server(&self) -> Result<(), CliError> {
        if self.identity()?.is_none() && self.ca.is_some() {
            return Err(CliError::Usage(
                "--tls-client-ca needs --tls-cert and --tls-key".into(),
            ));
        }
        Ok(())
    }

    /// Check a frontend's flags: a client certificate or a server name needs the CA.
    pub fn check_client(&self) -> Result<(), CliError> {
        let identity = self.identity()?;
        if self.ca.is_none() && (identity.is_some() || self.server_name.is_some()) {
            return Err(CliError::Usage(
                "--tls-cert, --tls-key and --tls-server-name need --tls-ca".into(),
            ));
        }
        Ok(())
    }

    /// The worker's TLS, if asked for (reads the files).
    pub fn server(&self) -> Result<Option<ServerTls>, String> {
        let Some((cert, key)) = self.identity().map_err(|_| "bad TLS flags".to_owned())? else {
            return Ok(None);
        };
        let identity = TlsIdentity::from_pem_files(cert, key).map_err(|e| e.to_string())?;
        let tls = match &self.ca {
            Some(ca) => {
                let roots = TlsRoots::from_pem_file(ca).map_err(|e| e.to_string())?;
                ServerTls::mutual(identity, roots)
            }
            None => ServerTls::new(identity),
        };
        tls.map(Some).map_err(|e| e.to_string())
    }

    /// The frontend's TLS, if asked for (reads the files).
    pub fn client(&self) -> Result<Option<ClientTls>, String> {
        let Some(ca) = &self.ca else {
            return Ok(None);
        };
        let roots = TlsRoots::from_pem_file(ca).map_err(|e| e.to_string())?;
        let identity = self.identity().map_err(|_| "bad TLS flags".to_owned())?;
        let tls = match identity {
            Some((cert, key)) => ClientTls::mutual(
                roots,
                TlsIdentity::from_pem_files(cert, key).map_err(|e| e.to_string())?,
            ),
            None => ClientTls::new(roots),
        }
        .map_err(|e| e.to_string())?;
        match &self.server_name {
            Some(name) => tls
                .with_server_name(name)
                .map(Some)
                .map_err(|e| e.to_string()),
            None => Ok(Some(tls)),
        }
    }

    /// Whether TLS is on (for the JSON events).
    pub fn enabled(&self, client_side: bool) -> bool {
        if client_side {
            self.ca.is_some()
        } else {
            self.cert.is_some()
        }
    }
}
