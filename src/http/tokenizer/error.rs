//! How turning a prompt into token ids fails.

/// A prompt that could not be turned into token ids: the request's error (400), never a
/// panic.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The chat template failed on these messages (`raise_exception`, a missing field...).
    #[error("chat template {template}: {message}")]
    Template {
        /// Where the template came from.
        template: String,
        /// What failed, with the template's line.
        message: String,
    },
    /// The model folder has no chat template, so chat requests cannot be rendered.
    #[error("the model in {dir} has no chat template")]
    NoTemplate {
        /// The model folder.
        dir: String,
    },
    /// The tokenizer failed on the text.
    #[error("tokenizing the prompt: {message}")]
    Encode {
        /// What the tokenizer said.
        message: String,
    },
}
