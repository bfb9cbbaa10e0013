//! The built-in tokenizer: small, deterministic, and prefix-stable, so that repeated chat turns
//! share prefix blocks and KV routing means something with mock engines.
//!
//! Rules (also in `docs/frontend.md`):
//! - a *word* is a maximal run of alphanumeric characters (`char::is_alphanumeric`);
//! - every other non-whitespace character is a piece of its own (punctuation, symbols);
//! - whitespace separates pieces and produces none;
//! - a piece's token id is the 32-bit FNV-1a hash of its UTF-8 bytes.
//!
//! So the tokens of a text that ends at a piece boundary (whitespace or punctuation) are a
//! prefix of the tokens of any text extending it. Output tokens are rendered as words of a
//! fixed vocabulary ([`render`]); nothing here is a real model's tokenizer.
//!
//! The frontend holds a [`Tokenizer`]: these words by default, or (feature `model-tokenizer`)
//! a `ModelTokenizer` read from a model folder, whose ids are a real engine's.

mod error;
#[cfg(feature = "model-tokenizer")]
mod incremental;
mod kind;
#[cfg(feature = "model-tokenizer")]
mod model;
#[cfg(feature = "model-tokenizer")]
mod template;

pub use error::PromptError;
pub use kind::{Detokenizer, Tokenizer};
#[cfg(feature = "model-tokenizer")]
pub use model::{LoadError, ModelTokenizer};

/// FNV-1a, 32 bits.
fn fnv1a(bytes: &[u8]) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for &b in bytes {
        hash ^= u32::from(b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash
}

/// The pieces of `text`, in order (see the module rules).
pub fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        rest = rest.trim_start();
        let first = rest.chars().next()?;
        let len = if first.is_alphanumeric() {
            rest.find(|c: char| !c.is_alphanumeric())
                .unwrap_or(rest.len())
        } else {
            first.len_utf8()
        };
        let (piece, tail) = rest.split_at(len);
        rest = tail;
        Some(piece)
    })
}

/// The token ids of `text`.
pub fn tokenize(text: &str) -> Vec<u32> {
    pieces(text).map(|p| fnv1a(p.as_bytes())).collect()
}

/// Words output tokens are rendered as.
const VOCABULARY: [&str; 32] = [
    "the", "prefill", "hop", "routes", "a", "request", "to", "one", "worker", "and", "decode",
    "streams", "tokens", "back", "while", "pool", "rolls", "over", "cache", "blocks", "are",
    "shared", "by", "turns", "of", "chat", "with", "kv", "aware", "routing", "on", "loopback",
];

/// The text of one output token: a vocabulary word, with a leading space.
pub fn render(token: u32) -> String {
    let word = VOCABULARY[token as usize % VOCABULARY.len()];
    format!(" {word}")
}

/// A chat message as the template sees it.
#[derive(Clone, Copy, Debug)]
pub struct Turn<'a> {
    /// `system`, `user`, `assistant`, ...
    pub role: &'a str,
    /// The message text.
    pub content: &'a str,
}

/// Render chat messages into one prompt with a stable template:
/// `<|ROLE|>\nCONTENT\n` per message, then `<|assistant|>\n`. Turn N+1's prompt (turn N's
/// messages, the assistant's reply, a new user message) starts with turn N's prompt exactly,
/// and it ends at a piece boundary, so its tokens are a prefix too.
pub fn chat_prompt<'a>(turns: impl IntoIterator<Item = Turn<'a>>) -> String {
    let mut prompt = String::new();
    for turn in turns {
        prompt.push_str("<|");
        prompt.push_str(turn.role);
        prompt.push_str("|>\n");
        prompt.push_str(turn.content);
        prompt.push('\n');
    }
    prompt.push_str("<|assistant|>\n");
    prompt
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_and_punctuation_are_pieces_and_whitespace_is_not() {
        let got: Vec<&str> = pieces("Hello, wörld!  it's 42\n<|user|>").collect();
        assert_eq!(
            got,
            ["Hello", ",", "wörld", "!", "it", "'", "s", "42", "<", "|", "user", "|", ">"]
        );
        assert!(tokenize("  \n\t").is_empty());
        assert_eq!(
            tokenize("a b"),
            tokenize("a\n\nb"),
            "whitespace only separates"
        );
        assert_ne!(tokenize("ab"), tokenize("a b"));
    }

    #[test]
    fn token_ids_are_fnv1a_of_the_piece() {
        // Published FNV-1a 32 test vectors.
        assert_eq!(fnv1a(b""), 0x811c_9dc5);
        assert_eq!(fnv1a(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a(b"foobar"), 0xbf9c_f968);
        assert_eq!(tokenize("foobar a"), vec![0xbf9c_f968, 0xe40c_292c]);
    }

    #[test]
    fn the_next_chat_turn_extends_the_previous_prompt_token_for_token() {
        let mut messages = vec![
            ("system", "You are terse."),
            ("user", "What is a prefill hop?"),
        ];
        let render_all = |m: &[(&'static str, &'static str)]| {
            chat_prompt(m.iter().map(|(role, content)| Turn { role, content }))
        };
        let first = tokenize(&render_all(&messages));
        messages.push(("assistant", "the prefill hop routes"));
        messages.push(("user", "And decode?"));
        let second = tokenize(&render_all(&messages));
        assert!(second.len() > first.len());
        assert_eq!(
            &second[..first.len()],
            &first[..],
            "turn 1 is a prefix of turn 2"
        );
    }

    #[test]
    fn rendering_is_deterministic_and_spaced() {
        assert_eq!(render(0), " the");
        assert_eq!(render(32), " the");
        assert_eq!(render(1), " prefill");
    }
}
