//! The session key of an HTTP request: the `x-session-id` header, else the body's `user`.

use axum::http::HeaderMap;

use super::openai::ApiError;

/// The header naming a request's session (for session affinity on the prefill hop).
pub const SESSION_HEADER: &str = "x-session-id";

/// Longest session key accepted, in bytes (the affinity table stores a hash, but a key is
/// also logged).
pub const MAX_SESSION_LEN: usize = 256;

/// The request's session key: the header when present (an explicit routing hint beats the
/// body's end-user id), else `user`. An empty header means none. A header that is not visible
/// ASCII, or either value over [`MAX_SESSION_LEN`], is a bad request.
pub(crate) fn session_key(
    headers: &HeaderMap,
    user: Option<String>,
) -> Result<Option<String>, ApiError> {
    let too_long = || {
        ApiError::bad_request(
            "invalid_session",
            format!("the session key must be at most {MAX_SESSION_LEN} bytes"),
        )
    };
    if let Some(value) = headers.get(SESSION_HEADER) {
        let text = value.to_str().map_err(|_| {
            ApiError::bad_request(
                "invalid_session",
                format!("the {SESSION_HEADER} header must be visible ASCII"),
            )
        })?;
        if text.len() > MAX_SESSION_LEN {
            return Err(too_long());
        }
        if !text.is_empty() {
            return Ok(Some(text.to_owned()));
        }
    }
    match user {
        Some(user) if user.len() > MAX_SESSION_LEN => Err(too_long()),
        Some(user) if user.is_empty() => Ok(None),
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(value: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(SESSION_HEADER, HeaderValue::from_bytes(value).unwrap());
        h
    }

    #[test]
    fn the_header_wins_over_the_body_user() {
        let key = session_key(&headers(b"conv-7"), Some("alice".into())).unwrap();
        assert_eq!(key.as_deref(), Some("conv-7"));
    }

    #[test]
    fn without_a_header_the_body_user_is_the_session() {
        let key = session_key(&HeaderMap::new(), Some("alice".into())).unwrap();
        assert_eq!(key.as_deref(), Some("alice"));
        assert_eq!(
            session_key(&headers(b""), Some("bob".into()))
                .unwrap()
                .as_deref(),
            Some("bob")
        );
        assert_eq!(
            session_key(&HeaderMap::new(), Some(String::new())).unwrap(),
            None
        );
        assert_eq!(session_key(&HeaderMap::new(), None).unwrap(), None);
    }

    #[test]
    fn oversized_or_non_ascii_keys_are_rejected() {
        let long = vec![b'a'; MAX_SESSION_LEN + 1];
        assert!(session_key(&headers(&long), None).is_err());
        assert!(session_key(&headers(&[0xC3, 0xA9]), None).is_err());
        let long_user = "u".repeat(MAX_SESSION_LEN + 1);
        assert!(session_key(&HeaderMap::new(), Some(long_user)).is_err());
        let exact = vec![b'a'; MAX_SESSION_LEN];
        assert!(session_key(&headers(&exact), None).unwrap().is_some());
    }
}
