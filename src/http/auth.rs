//! API keys of the frontend: the accepted set, read from a key file, and the constant-time
//! check of a request's `Authorization: Bearer` header.
//!
//! The keys are secrets: nothing here formats one (`Debug` prints how many there are, errors
//! name a line number), and the check compares the presented key with every accepted key, each
//! byte of each, so its time does not tell how close a guess came nor which key matched.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::openai::ApiError;

/// A set of accepted API keys (at least one). Cheap to clone (shared).
#[derive(Clone)]
pub struct ApiKeys {
    keys: Arc<[Box<[u8]>]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys: configs are logged and printed in test failures.
        f.debug_struct("ApiKeys")
            .field("count", &self.keys.len())
            .finish()
    }
}

/// Why a key file or a list of keys was refused. No variant holds a key.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The file could not be read.
    #[error("reading the API key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file is not UTF-8 text.
    #[error("the API key file is not UTF-8 text")]
    NotText,
    /// No key: only blank lines and comments (an empty set would lock every client out, or,
    /// worse, be mistaken for "no keys needed").
    #[error("no API key: the key file holds only blank lines and comments")]
    Empty,
    /// A key with whitespace inside it (two keys on one line, or a pasted line break gone
    /// wrong); `line` counts from 1.
    #[error("line {line}: an API key must not contain whitespace (one key per line)")]
    Whitespace {
        /// The line (or, for [`ApiKeys::new`], the position in the list), from 1.
        line: usize,
    },
    /// A key with a control character, which no HTTP header can carry.
    #[error("line {line}: an API key must not contain control characters")]
    Control {
        /// The line (or, for [`ApiKeys::new`], the position in the list), from 1.
        line: usize,
    },
}

/// One key's line checked: `None` for a blank line or a comment.
fn key_of(line: usize, raw: &str) -> Result<Option<Box<[u8]>>, KeysError> {
    let key = raw.trim();
    if key.is_empty() || key.starts_with('#') {
        return Ok(None);
    }
    if key.chars().any(char::is_whitespace) {
        return Err(KeysError::Whitespace { line });
    }
    if key.chars().any(char::is_control) {
        return Err(KeysError::Control { line });
    }
    Ok(Some(key.as_bytes().into()))
}

impl ApiKeys {
    /// The keys of a key file's text: one key per line, surrounding whitespace trimmed, blank
    /// lines and lines starting with `#` ignored; at least one key.
    pub fn parse(text: &str) -> Result<ApiKeys, KeysError> {
        let mut keys = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            if let Some(key) = key_of(i + 1, raw)? {
                keys.push(key);
            }
        }
        ApiKeys::from_vec(keys)
    }

    /// The keys of the key file at `path` (see [`ApiKeys::parse`]).
    pub fn from_file(path: &Path) -> Result<ApiKeys, KeysError> {
        let bytes = std::fs::read(path).map_err(|source| KeysError::Read {
            path: path.to_owned(),
            source,
        })?;
        // from_utf8's error would quote the bytes around the bad one: part of a key.
        let text = String::from_utf8(bytes).map_err(|_| KeysError::NotText)?;
        ApiKeys::parse(&text)
    }

    /// The keys given, each held to the rules of a key file's line (a blank entry or one
    /// starting with `#` is skipped); at least one key.
    pub fn new<I, K>(keys: I) -> Result<ApiKeys, KeysError>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        let mut out = Vec::new();
        for (i, key) in keys.into_iter().enumerate() {
            if let Some(key) = key_of(i + 1, key.as_ref())? {
                out.push(key);
            }
        }
        ApiKeys::from_vec(out)
    }

    fn from_vec(mut keys: Vec<Box<[u8]>>) -> Result<ApiKeys, KeysError> {
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            return Err(KeysError::Empty);
        }
        Ok(ApiKeys { keys: keys.into() })
    }

    /// How many distinct keys are accepted.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Always false: a set holds at least one key (for the `len_without_is_empty` lint).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether `presented` is one of the keys, in constant time: every accepted key is
    /// compared in full, whatever matched (see `ct_eq` in this file for what the time still depends on).
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut found = 0u8;
        for key in self.keys.iter() {
            found |= ct_eq(key, presented);
        }
        std::hint::black_box(found) == 1
    }

    /// Whether the request's headers carry an accepted key: `Authorization: Bearer KEY` (the
    /// scheme in any case, as RFC 9110 has it).
    pub fn authorizes(&self, headers: &HeaderMap) -> Result<(), AuthError> {
        let value = headers
            .get(header::AUTHORIZATION)
            .ok_or(AuthError::Missing)?;
        let key = bearer(value).ok_or(AuthError::Missing)?;
        if self.accepts(key) {
            Ok(())
        } else {
            Err(AuthError::Invalid)
        }
    }
}

/// The token of a `Bearer` credential, `None` for another scheme.
fn bearer(value: &HeaderValue) -> Option<&[u8]> {
    let bytes = value.as_bytes();
    let scheme = bytes.get(..7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    Some(bytes[7..].trim_ascii())
}

/// 1 if `key` and `presented` are equal, else 0. The loop runs over every byte of `key`
/// whatever `presented` holds, folding differences into one byte with no branch on them, so
/// the time depends on the key's length only (not on where a guess first differs); the
/// length itself is not hidden, as in every constant-time comparison of unequal lengths.
fn ct_eq(key: &[u8], presented: &[u8]) -> u8 {
    let mut diff = u8::from(key.len() != presented.len());
    for (i, k) in key.iter().enumerate() {
        // Past the end of a shorter `presented`, compare against 0: the lengths already
        // differ, and the loop must still run to the key's end.
        let p = presented.get(i).copied().unwrap_or(0);
        diff |= k ^ p;
    }
    // black_box: keep the optimiser from turning the fold into an early-exit comparison.
    let diff = std::hint::black_box(diff);
    // 1 exactly when diff == 0, computed without a branch.
    (((u16::from(diff)).wrapping_sub(1) >> 8) & 1) as u8
}

/// Why a request was refused (both are 401 `invalid_api_key`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A bearer key that is not accepted.
    Invalid,
}

impl AuthError {
    /// The OpenAI error body (never echoing what was presented).
    pub fn api_error(self) -> ApiError {
        let message = match self {
            AuthError::Missing => {
                "You didn't provide an API key. Send it in an Authorization header using Bearer \
                 auth (Authorization: Bearer YOUR_KEY)."
            }
            AuthError::Invalid => "Incorrect API key provided.",
        };
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            code: "invalid_api_key",
            message: message.to_owned(),
        }
    }
}

impl IntoResponse for AuthError {
    fn into_response(self) -> Response {
        let mut response = self.api_error().into_response();
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(text: &str) -> ApiKeys {
        ApiKeys::parse(text).unwrap()
    }

    #[test]
    fn a_key_file_skips_comments_and_blanks_and_trims() {
        let k = keys("# production keys\n\n  sk-one  \n\t# rotated 2024\nsk-two\r\n\nsk-one\n");
        assert_eq!(k.len(), 2, "sk-one counted once");
        assert!(k.accepts(b"sk-one"));
        assert!(k.accepts(b"sk-two"));
        assert!(!k.accepts(b"# production keys"));
        assert!(!k.accepts(b""));
        assert!(!k.accepts(b"  sk-one  "));
    }

    #[test]
    fn bad_key_files_name_the_line_never_the_key() {
        for (text, want) in [
            ("", "no API key"),
            ("# only a comment\n\n   \n", "no API key"),
            ("sk-good\nsk-secret-a sk-secret-b\n", "line 2"),
            ("\n\n\nsk-secret\u{7}x\n", "line 4"),
        ] {
            let error = ApiKeys::parse(text).unwrap_err();
            let shown = format!("{error} {error:?}");
            assert!(shown.contains(want), "{text:?}: {shown}");
            assert!(!shown.contains("secret"), "{text:?}: {shown}");
        }
        assert!(matches!(
            ApiKeys::parse("a\nb c"),
            Err(KeysError::Whitespace { line: 2 })
        ));
        assert!(matches!(
            ApiKeys::new(["k1", "", "k\u{0}3"]),
            Err(KeysError::Control { line: 3 })
        ));
        assert!(matches!(ApiKeys::new([" "]), Err(KeysError::Empty)));
    }

    #[test]
    fn a_file_that_is_not_text_or_missing_is_a_typed_error_without_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, b"sk-secret\xff\n").unwrap();
        let error = ApiKeys::from_file(&path).unwrap_err();
        assert!(matches!(error, KeysError::NotText));
        assert!(!format!("{error} {error:?}").contains("secret"));
        let missing = ApiKeys::from_file(&dir.path().join("absent")).unwrap_err();
        assert!(matches!(missing, KeysError::Read { .. }), "{missing}");
        std::fs::write(&path, "sk-secret\n").unwrap();
        assert!(ApiKeys::from_file(&path).unwrap().accepts(b"sk-secret"));
    }

    #[test]
    fn debug_prints_a_count_not_the_keys() {
        let shown = format!("{:?}", keys("sk-secret-1\nsk-secret-2\n"));
        assert_eq!(shown, "ApiKeys { count: 2 }");
    }

    #[test]
    fn ct_eq_is_equality_over_prefixes_and_lengths() {
        let cases: [(&[u8], &[u8], bool); 10] = [
            (b"sk-abc", b"sk-abc", true),
            (b"sk-abc", b"sk-abd", false),
            (b"sk-abc", b"sk-ab", false),
            (b"sk-abc", b"sk-abcd", false),
            (b"sk-abc", b"", false),
            (b"sk-abc", b"tk-abc", false),
            // A presented key padded with the bytes the loop substitutes past its end.
            (b"sk-ab\0", b"sk-ab", false),
            (b"sk-ab", b"sk-ab\0", false),
            (b"a", b"a", true),
            (b"\xff", b"\xfe", false),
        ];
        for (key, presented, equal) in cases {
            assert_eq!(
                ct_eq(key, presented) == 1,
                equal,
                "{key:?} vs {presented:?}"
            );
            assert_eq!(ct_eq(key, presented) == 1, key == presented);
        }
    }

    #[test]
    fn any_key_of_the_set_is_accepted_and_nothing_else() {
        // Keys that share prefixes and differ in length: only exact matches pass.
        let k = ApiKeys::new(["sk-a", "sk-ab", "sk-abc", "other"]).unwrap();
        for good in ["sk-a", "sk-ab", "sk-abc", "other"] {
            assert!(k.accepts(good.as_bytes()), "{good}");
        }
        for bad in ["sk-", "sk-abcd", "sk-b", "othe", "others", "", "SK-A"] {
            assert!(!k.accepts(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn the_bearer_header_is_read_case_insensitively_and_trimmed() {
        let k = keys("sk-live\n");
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
            k.authorizes(&headers)
        };
        assert_eq!(k.authorizes(&HeaderMap::new()), Err(AuthError::Missing));
        assert_eq!(with("Bearer sk-live"), Ok(()));
        assert_eq!(with("bearer sk-live "), Ok(()));
        assert_eq!(with("BEARER  sk-live"), Ok(()));
        assert_eq!(with("Bearer sk-lived"), Err(AuthError::Invalid));
        assert_eq!(with("Bearer "), Err(AuthError::Invalid));
        assert_eq!(with("Basic c2stbGl2ZQ=="), Err(AuthError::Missing));
        assert_eq!(with("sk-live"), Err(AuthError::Missing));
        assert_eq!(with("Bearer"), Err(AuthError::Missing));
    }

    #[test]
    fn the_401_is_an_openai_body_with_www_authenticate() {
        let response = AuthError::Invalid.into_response();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            response.headers().get(header::WWW_AUTHENTICATE).unwrap(),
            "Bearer"
        );
        let body = AuthError::Missing.api_error().body();
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(body["error"]["param"].is_null());
    }
}
