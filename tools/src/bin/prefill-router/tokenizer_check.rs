//! `serve --tokenizer DIR [--check-tokenizer URL]`: load the model's tokenizer, and refuse to
//! start when it tokenizes differently from the engine's `POST URL/tokenize` (vLLM's), which
//! would make KV routing and the engine's prompt disagree silently.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use prefill_router::http::tokenizer::Turn;
use prefill_router::http::{LoadError, ModelTokenizer, PromptError, Tokenizer};
use tokio::net::TcpStream;

/// Completion prompts compared: ASCII, whitespace runs, unicode split over byte tokens, the
/// text of a special token.
const PROMPTS: [&str; 4] = [
    "Hello, world! The prefill hop routes a request.",
    "  spaces,\ttabs\n\nand newlines   ",
    "unicode: héllo wörld, 日本語, emoji 🙂",
    "<s> special token text </s>",
];

/// A two-turn chat with a system prompt, through the chat template.
const CHAT: [(&str, &str); 4] = [
    ("system", "You are terse."),
    ("user", "What is a prefill hop?"),
    ("assistant", "A hop that routes prefill."),
    ("user", "And decode? 🙂"),
];

/// Largest `/tokenize` answer read.
const MAX_ANSWER: usize = 1 << 20;
/// Each `/tokenize` call's bound (connect, send, answer).
const TIMEOUT: Duration = Duration::from_secs(10);

/// Why serve refused the tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerCheckError {
    /// The model folder did not load (names the file).
    #[error("--tokenizer: {0}")]
    Load(#[from] LoadError),
    /// Our side could not tokenize a check prompt (the chat template failed on it).
    #[error("--tokenizer: check prompt {prompt}: {source}")]
    Prompt {
        /// The prompt (JSON).
        prompt: String,
        /// Why.
        source: PromptError,
    },
    /// The engine's `/tokenize` could not be asked or answered nonsense.
    #[error("--check-tokenizer {url}: {message}")]
    Engine {
        /// The engine URL given.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The engine tokenizes a check prompt differently.
    #[error("--check-tokenizer {url}: the engine tokenizes {prompt} as {engine:?}, the model folder as {ours:?}")]
    Mismatch {
        /// The engine URL given.
        url: String,
        /// The first prompt that differs (JSON: a text, or chat messages).
        prompt: String,
        /// The engine's ids.
        engine: Vec<u32>,
        /// Ours.
        ours: Vec<u32>,
    },
}

/// Load `dir`, and with `check`, compare it with the engine at that URL.
pub async fn load(dir: &Path, check: Option<&str>) -> Result<Tokenizer, TokenizerCheckError> {
    let model = Arc::new(ModelTokenizer::from_dir(dir)?);
    if let Some(url) = check {
        compare(&model, url).await?;
    }
    Ok(Tokenizer::Model(model))
}

/// Every check prompt, ours against the engine's, the first difference an error.
async fn compare(model: &ModelTokenizer, url: &str) -> Result<usize, TokenizerCheckError> {
    let engine = Engine::parse(url)?;
    let mut cases = Vec::new();
    for prompt in PROMPTS {
        let ours = model.encode_prompt(prompt);
        cases.push((serde_json::json!({"prompt": prompt}), ours));
    }
    if model.has_chat_template() {
        let turns: Vec<Turn<'_>> = CHAT
            .iter()
            .map(|&(role, content)| Turn { role, content })
            .collect();
        let messages: Vec<_> = CHAT
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        let body = serde_json::json!({"messages": messages, "add_generation_prompt": true});
        cases.push((body, model.encode_chat(&turns)));
    }
    let count = cases.len();
    for (body, ours) in cases {
        let ours = ours.map_err(|source| TokenizerCheckError::Prompt {
            prompt: body.to_string(),
            source,
        })?;
        let theirs = engine.tokenize(&body).await?;
        if theirs != ours {
            return Err(TokenizerCheckError::Mismatch {
                url: url.to_owned(),
                prompt: body.to_string(),
                engine: theirs,
                ours,
            });
        }
    }
    Ok(count)
}

/// `http://HOST:PORT[/PREFIX]`.
struct Engine {
    url: String,
    authority: String,
    path: String,
}

impl Engine {
    fn parse(url: &str) -> Result<Self, TokenizerCheckError> {
        let bad = |message: &str| TokenizerCheckError::Engine {
            url: url.to_owned(),
            message: message.to_owned(),
        };
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("expected http://HOST:PORT"))?;
        let (authority, prefix) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        if authority.is_empty() {
            return Err(bad("expected http://HOST:PORT"));
        }
        let authority = if authority.contains(':') && !authority.ends_with(']') {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        Ok(Engine {
            url: url.to_owned(),
            authority,
            path: format!("{}/tokenize", prefix.trim_end_matches('/')),
        })
    }

    fn error(&self, message: impl std::fmt::Display) -> TokenizerCheckError {
        TokenizerCheckError::Engine {
            url: self.url.clone(),
            message: message.to_string(),
        }
    }

    /// `POST /tokenize` with `body`; its `tokens`.
    async fn tokenize(&self, body: &serde_json::Value) -> Result<Vec<u32>, TokenizerCheckError> {
        let exchange = async {
            let stream = TcpStream::connect(&self.authority)
                .await
                .map_err(|e| self.error(format!("connecting to {}: {e}", self.authority)))?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| self.error(e))?;
            tokio::spawn(connection);
            let request = hyper::Request::post(&self.path)
                .header(hyper::header::HOST, &self.authority)
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .map_err(|e| self.error(e))?;
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| self.error(e))?;
            let status = response.status();
            let bytes = Limited::new(response.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| self.error(format!("reading the answer: {e}")))?
                .to_bytes();
            if !status.is_success() {
                let text = String::from_utf8_lossy(&bytes);
                return Err(self.error(format!("POST {} answered {status}: {text}", self.path)));
            }
            Ok(bytes)
        };
        let bytes = tokio::time::timeout(TIMEOUT, exchange)
            .await
            .map_err(|_| self.error(format!("no answer within {TIMEOUT:?}")))??;
        let answer: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| self.error(format!("answer: {e}")))?;
        answer["tokens"]
            .as_array()
            .and_then(|ids| {
                ids.iter()
                    .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| self.error("the answer has no `tokens` array of ids"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-llama")
    }

    #[test]
    fn engine_urls_are_read_or_refused() {
        let engine = Engine::parse("http://127.0.0.1:8100").ok().unwrap();
        assert_eq!(
            (&*engine.authority, &*engine.path),
            ("127.0.0.1:8100", "/tokenize")
        );
        let engine = Engine::parse("http://host/v1/").ok().unwrap();
        assert_eq!(
            (&*engine.authority, &*engine.path),
            ("host:80", "/v1/tokenize")
        );
        for bad in ["127.0.0.1:8100", "https://x", "http://", "http:///x"] {
            assert!(
                matches!(Engine::parse(bad), Err(TokenizerCheckError::Engine { .. })),
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn a_missing_folder_is_named() {
        let error = load(Path::new("/nonexistent/model"), None)
            .await
            .unwrap_err();
        assert!(error.to_string().contains("/nonexistent/model"), "{error}");
        assert!(load(&fixture(), None).await.is_ok());
    }

    /// A fake engine's `/tokenize` under `/v1`: the model folder's own ids (so they agree),
    /// or with `wrong_chat` other ids for chat requests.
    async fn fake_engine(wrong_chat: bool) -> String {
        let model = Arc::new(ModelTokenizer::from_dir(fixture()).unwrap());
        let tokenize = move |axum::Json(body): axum::Json<serde_json::Value>| {
            let model = Arc::clone(&model);
            async move {
                let tokens = match body["prompt"].as_str() {
                    Some(prompt) => model.encode_prompt(prompt).unwrap(),
                    None if wrong_chat => vec![1, 2, 3],
                    None => {
                        let messages = body["messages"].as_array().unwrap();
                        let turns: Vec<Turn<'_>> = messages
                            .iter()
                            .map(|m| Turn {
                                role: m["role"].as_str().unwrap(),
                                content: m["content"].as_str().unwrap(),
                            })
                            .collect();
                        model.encode_chat(&turns).unwrap()
                    }
                };
                axum::Json(serde_json::json!({"count": tokens.len(), "tokens": tokens}))
            }
        };
        let app = axum::Router::new().route("/v1/tokenize", axum::routing::post(tokenize));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/v1")
    }

    #[tokio::test]
    async fn an_engine_that_tokenizes_otherwise_is_refused_naming_the_prompt() {
        let agreeing = fake_engine(false).await;
        assert!(load(&fixture(), Some(&agreeing)).await.is_ok());
        let disagreeing = fake_engine(true).await;
        let error = load(&fixture(), Some(&disagreeing)).await.unwrap_err();
        assert!(
            matches!(&error, TokenizerCheckError::Mismatch { prompt, engine, .. }
                if prompt.contains("You are terse.") && engine == &[1, 2, 3]),
            "{error}"
        );
        // Nothing listening: an engine error naming the URL, not a hang.
        let error = load(&fixture(), Some("http://127.0.0.1:1"))
            .await
            .unwrap_err();
        assert!(error.to_string().contains("http://127.0.0.1:1"), "{error}");
    }

    /// With a live engine serving the fixture's model (PREFILL_VLLM_URL, e.g.
    /// http://127.0.0.1:8100): every check prompt agrees.
    #[tokio::test]
    async fn the_live_engine_tokenizes_as_the_model_folder() {
        let Ok(url) = std::env::var("PREFILL_VLLM_URL") else {
            eprintln!("PREFILL_VLLM_URL unset: skipped");
            return;
        };
        let model = ModelTokenizer::from_dir(fixture()).unwrap();
        let checked = compare(&model, &url).await.unwrap();
        assert_eq!(checked, PROMPTS.len() + 1);
    }
}
