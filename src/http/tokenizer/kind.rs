//! Which tokenizer the frontend uses: the built-in word tokenizer (the default, what the mock
//! engines understand) or, with feature `model-tokenizer`, a real model's. Every prompt and
//! every output token goes through the one [`HttpConfig::tokenizer`](crate::http::HttpConfig).

#[cfg(feature = "model-tokenizer")]
use std::sync::Arc;

#[cfg(feature = "model-tokenizer")]
use super::incremental::Incremental;
#[cfg(feature = "model-tokenizer")]
use super::ModelTokenizer;
use super::PromptError;
use super::{chat_prompt, render, tokenize, Turn};

/// The frontend's tokenizer.
#[derive(Clone, Debug, Default)]
pub enum Tokenizer {
    /// The built-in word tokenizer (module [`tokenizer`](super)): prompts hashed word by
    /// word, output tokens rendered as vocabulary words. For mock engines.
    #[default]
    Words,
    /// A real model's tokenizer and chat template (feature `model-tokenizer`).
    #[cfg(feature = "model-tokenizer")]
    Model(Arc<ModelTokenizer>),
}

impl Tokenizer {
    /// The ids of a completion's text prompt.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        match self {
            Tokenizer::Words => Ok(tokenize(text)),
            #[cfg(feature = "model-tokenizer")]
            Tokenizer::Model(model) => model.encode_prompt(text),
        }
    }

    /// The ids of a chat request's messages, through the chat template, with the generation
    /// prompt.
    pub fn encode_chat(&self, turns: &[Turn<'_>]) -> Result<Vec<u32>, PromptError> {
        match self {
            Tokenizer::Words => Ok(tokenize(&chat_prompt(turns.iter().copied()))),
            #[cfg(feature = "model-tokenizer")]
            Tokenizer::Model(model) => model.encode_chat(turns),
        }
    }

    /// The output text decoder of one reply to `prompt` (whose last tokens give a model's
    /// decoder its context).
    pub fn detokenizer(&self, prompt: &[u32]) -> Detokenizer {
        match self {
            Tokenizer::Words => {
                let _ = prompt;
                Detokenizer(Inner::Words)
            }
            #[cfg(feature = "model-tokenizer")]
            Tokenizer::Model(model) => {
                Detokenizer(Inner::Model(Incremental::new(Arc::clone(model), prompt)))
            }
        }
    }
}

/// Output text of one reply, token batch by token batch: for a streamed reply each batch's
/// text as soon as it is whole characters, for a collected one all at once.
#[derive(Clone, Debug)]
pub struct Detokenizer(Inner);

#[derive(Clone, Debug)]
enum Inner {
    Words,
    #[cfg(feature = "model-tokenizer")]
    Model(Incremental),
}

impl Detokenizer {
    /// The text `ids` add to the reply. `last`: the reply ends with them, so nothing is held
    /// back (a model's incomplete last character comes out as U+FFFD, as a full decode
    /// writes it).
    pub fn push(&mut self, ids: &[u32], last: bool) -> String {
        match &mut self.0 {
            Inner::Words => {
                let _ = last;
                ids.iter().map(|&t| render(t)).collect()
            }
            #[cfg(feature = "model-tokenizer")]
            Inner::Model(model) => model.push(ids, last),
        }
    }

    /// The whole text of a reply of `ids` (this decoder's state is left as it is).
    pub fn whole(&self, ids: &[u32]) -> String {
        self.clone().push(ids, true)
    }
}
