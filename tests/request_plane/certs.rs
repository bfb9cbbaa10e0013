//! Certificates made at test time (rcgen, ECDSA P-256): a CA, leaves it signs (current or
//! expired), written to a directory as PEM for the file-based constructors and the CLI.
//! Shared with benches/push.rs, tools/tests/frontend_processes/ and tools/benches/serve.rs
//! through `#[path]`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A certificate authority.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// Whether a leaf is valid now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Validity {
    /// rcgen's default span (1975 to 4096).
    Current,
    /// Valid in 2000 only: rejected by any verifier that checks the time.
    Expired,
}

/// A leaf certificate and its key, as PEM.
pub struct Leaf {
    /// The certificate (the leaf alone; the CA is the trust root).
    pub cert_pem: String,
    /// Its PKCS#8 private key.
    pub key_pem: String,
}

impl Ca {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("CA key");
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).expect("CA certificate"),
        }
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf for `sans` (IP addresses become IP SANs, the rest DNS names), usable as a
    /// server and as a client certificate.
    pub fn leaf(&self, sans: &[&str], validity: Validity) -> Leaf {
        let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
        let mut params = CertificateParams::new(sans).expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, "request plane");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        if validity == Validity::Expired {
            params.not_before = rcgen::date_time_ymd(2000, 1, 1);
            params.not_after = rcgen::date_time_ymd(2000, 12, 31);
        }
        let key = KeyPair::generate().expect("leaf key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// Write the CA certificate to `dir/name`.
    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, self.pem()).expect("write CA");
        path
    }
}

impl Leaf {
    /// Write to `dir/{name}.crt` and `dir/{name}.key`; returns (certificate, key) paths.
    pub fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{name}.crt"));
        let key = dir.join(format!("{name}.key"));
        std::fs::write(&cert, &self.cert_pem).expect("write certificate");
        std::fs::write(&key, &self.key_pem).expect("write key");
        (cert, key)
    }
}
