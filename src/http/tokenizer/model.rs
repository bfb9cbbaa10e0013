//! A real model's tokenizer, read from a local model folder (feature `model-tokenizer`): its
//! `tokenizer.json` through Hugging Face's `tokenizers`, its chat template from
//! `chat_template.jinja` or `tokenizer_config.json`. The token ids the frontend routes on and
//! sends to the engine are then the engine's own.

use std::path::{Path, PathBuf};

use super::template::{describe, ChatTemplate};
use super::{PromptError, Turn};

/// A model folder that could not be loaded; every variant names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The folder is missing or is not a directory.
    #[error("model folder {}: not a directory", dir.display())]
    NoDir {
        /// The folder given.
        dir: PathBuf,
    },
    /// A file could not be read (missing, unreadable).
    #[error("{}: {source}", file.display())]
    Read {
        /// The file.
        file: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a tokenizer `tokenizers` can load.
    #[error("{}: not a valid tokenizer: {message}", file.display())]
    Tokenizer {
        /// The file.
        file: PathBuf,
        /// What `tokenizers` said.
        message: String,
    },
    /// `tokenizer_config.json` is not JSON, or a field of it has the wrong shape.
    #[error("{}: {message}", file.display())]
    Config {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template does not compile.
    #[error("{}: the chat template does not compile: {message}", file.display())]
    Template {
        /// The file the template came from (`chat_template.jinja` or `tokenizer_config.json`).
        file: PathBuf,
        /// minijinja's error, with its line.
        message: String,
    },
}

/// A model's tokenizer and chat template. Cheap to share behind an `Arc` (the frontend's
/// [`Tokenizer::Model`](super::Tokenizer::Model)); every method takes `&self`.
pub struct ModelTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    /// `None`: the model has none; chat requests are refused (completions still work).
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .field("chat_template", &self.template.as_ref().map(|t| &t.origin))
            .finish_non_exhaustive()
    }
}

fn read(file: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(file).map_err(|source| LoadError::Read {
        file: file.to_owned(),
        source,
    })
}

/// A special token as tokenizer_config.json writes it: a string, or an `AddedToken` object
/// with its text in `content`.
fn token_text(value: &serde_json::Value) -> Option<&str> {
    value
        .as_str()
        .or_else(|| value.get("content").and_then(serde_json::Value::as_str))
}

/// The special-token strings a template's context carries (transformers passes the
/// tokenizer's special tokens map).
const SPECIAL: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

/// `chat_template` of tokenizer_config.json: a string, or a list of `{name, template}` of
/// which `default` is the one a plain chat request uses.
fn config_template(config: &serde_json::Value, file: &Path) -> Result<Option<String>, LoadError> {
    let bad = |message: &str| LoadError::Config {
        file: file.to_owned(),
        message: message.to_owned(),
    };
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(source)) => Ok(Some(source.clone())),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(serde_json::Value::as_str))
            .map(|source| Some(source.to_owned()))
            .ok_or_else(|| bad("chat_template is a list without a template named `default`")),
        Some(_) => Err(bad(
            "chat_template must be a string or a list of named templates",
        )),
    }
}

impl ModelTokenizer {
    /// Load the model folder `dir`: `tokenizer.json` (required), `tokenizer_config.json`
    /// (optional: the special tokens, and the chat template unless `chat_template.jinja` is
    /// there, which wins as it does in transformers).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        let dir = dir.as_ref().to_owned();
        if !dir.is_dir() {
            return Err(LoadError::NoDir { dir });
        }
        let file = dir.join("tokenizer.json");
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(read(&file)?).map_err(|e| LoadError::Tokenizer {
                message: e.to_string(),
                file,
            })?;
        let config_file = dir.join("tokenizer_config.json");
        let config = if config_file.exists() {
            serde_json::from_slice(&read(&config_file)?).map_err(|e| LoadError::Config {
                file: config_file.clone(),
                message: format!("not valid JSON: {e}"),
            })?
        } else {
            serde_json::Value::Null
        };
        if !config.is_null() && !config.is_object() {
            return Err(LoadError::Config {
                file: config_file,
                message: "not a JSON object".into(),
            });
        }
        let special = SPECIAL
            .iter()
            .filter_map(|name| {
                let text = token_text(config.get(*name)?)?;
                Some(((*name).to_owned(), text.to_owned()))
            })
            .collect();
        let jinja = dir.join("chat_template.jinja");
        let (source, origin) = if jinja.exists() {
            let bytes = read(&jinja)?;
            let source = String::from_utf8(bytes).map_err(|_| LoadError::Template {
                file: jinja.clone(),
                message: "not UTF-8".into(),
            })?;
            (Some(source), jinja)
        } else {
            (config_template(&config, &config_file)?, config_file)
        };
        let template = match source {
            None => None,
            Some(source) => Some(
                ChatTemplate::compile(source, origin.display().to_string(), special).map_err(
                    |e| LoadError::Template {
                        file: origin,
                        message: describe(&e),
                    },
                )?,
            ),
        };
        Ok(ModelTokenizer {
            dir,
            tokenizer,
            template,
        })
    }

    /// The folder it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the model has a chat template (without one, chat requests are refused).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| PromptError::Encode {
                message: e.to_string(),
            })
    }

    /// The ids of a completion's text prompt: with the tokenizer's special tokens (a BOS if its
    /// post-processor adds one), as transformers' `encode(text)` and vLLM's completions do.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        self.encode(text, true)
    }

    /// The chat prompt text of `turns`: the chat template rendered with
    /// `add_generation_prompt`.
    pub fn chat_text(&self, turns: &[Turn<'_>]) -> Result<String, PromptError> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| PromptError::NoTemplate {
                dir: self.dir.display().to_string(),
            })?;
        template.render(turns)
    }

    /// The ids of a chat prompt: [`ModelTokenizer::chat_text`] encoded without adding special
    /// tokens (the template writes its own BOS), as `apply_chat_template(tokenize=True)` does.
    pub fn encode_chat(&self, turns: &[Turn<'_>]) -> Result<Vec<u32>, PromptError> {
        self.encode(&self.chat_text(turns)?, false)
    }

    /// The text of `ids`, special tokens skipped. Ids the vocabulary lacks are skipped (as
    /// `tokenizers` does); bytes that are not UTF-8 become U+FFFD. A decoder failure gives the
    /// empty string (logged): output text is never worth a panic or a lost stream.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self.tokenizer.decode(ids, true) {
            Ok(text) => text,
            Err(error) => {
                tracing::warn!(%error, "decoding output tokens failed");
                String::new()
            }
        }
    }
}
