//! Streaming detokenization for a model tokenizer: output text grows token by token without
//! ever splitting a UTF-8 character (a byte-level BPE token may hold part of one) and without
//! losing the spaces a decoder only writes between tokens. vLLM's approach: decode a window
//! `ids[prefix_offset..]` and emit what it adds to `ids[prefix_offset..read_offset]` (here the
//! window starts at the prefix offset, so that is `ids[..read_offset]`), once the
//! addition does not end in an incomplete character (U+FFFD).

use std::sync::Arc;

use super::ModelTokenizer;

/// How many of the prompt's last tokens seed the window at most (vLLM's bound): enough
/// context for decoders that treat a sequence's first token differently (SentencePiece's
/// leading space).
const MAX_PRIME: usize = 24;
/// And at least (when the prompt is longer).
const MIN_PRIME: usize = 4;

/// The incremental decoder of one reply.
#[derive(Clone, Debug)]
pub(super) struct Incremental {
    tokenizer: Arc<ModelTokenizer>,
    /// The window: `ids[..read_offset]` is context already emitted (or the prompt's end),
    /// the rest ids not emitted yet.
    ids: Vec<u32>,
    read_offset: usize,
}

impl Incremental {
    /// A decoder whose window starts with the end of `prompt` (never emitted).
    pub(super) fn new(tokenizer: Arc<ModelTokenizer>, prompt: &[u32]) -> Self {
        // The shortest suffix of at least MIN_PRIME tokens that decodes to whole characters;
        // a suffix cut inside a character would put a U+FFFD into the context.
        let mut prime: &[u32] = prompt
            .get(prompt.len().saturating_sub(MIN_PRIME)..)
            .unwrap_or(&[]);
        for n in MIN_PRIME..=MAX_PRIME.min(prompt.len()) {
            let suffix = &prompt[prompt.len() - n..];
            prime = suffix;
            if !tokenizer.decode(suffix).contains('\u{FFFD}') {
                break;
            }
        }
        Incremental {
            tokenizer,
            ids: prime.to_vec(),
            read_offset: prime.len(),
        }
    }

    /// The text `ids` add; with `last`, also whatever was held back (an incomplete character
    /// at the very end comes out as U+FFFD, as a full decode writes it).
    pub(super) fn push(&mut self, ids: &[u32], last: bool) -> String {
        let mut out = String::new();
        for &id in ids {
            self.ids.push(id);
            out.push_str(&self.step(false));
        }
        if last {
            out.push_str(&self.step(true));
        }
        out
    }

    /// What the window adds past its emitted part, if it ends in whole characters (or `force`).
    fn step(&mut self, force: bool) -> String {
        if self.read_offset >= self.ids.len() {
            return String::new();
        }
        let prefix_text = self.tokenizer.decode(&self.ids[..self.read_offset]);
        let new_text = self.tokenizer.decode(&self.ids);
        if !force && (new_text.len() <= prefix_text.len() || new_text.ends_with('\u{FFFD}')) {
            // Nothing yet, or a character still incomplete: wait for the next token.
            return String::new();
        }
        let delta = match new_text.strip_prefix(prefix_text.as_str()) {
            Some(delta) => delta.to_owned(),
            // A decoder that rewrote the context (cleanup rules): emit past the common part.
            None => {
                let common = new_text
                    .char_indices()
                    .zip(prefix_text.chars())
                    .take_while(|((_, a), b)| a == b)
                    .last()
                    .map_or(0, |((i, c), _)| i + c.len_utf8());
                new_text.get(common..).unwrap_or_default().to_owned()
            }
        };
        // The tokens just emitted become the next window's context (vLLM's prefix offset
        // moving to the read offset); older ones are dropped, so the window stays a few
        // tokens long however long the reply.
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        delta
    }
}
