//! A Hugging Face chat template (Jinja) compiled with minijinja, rendered the way transformers'
//! `apply_chat_template` does: `trim_blocks` and `lstrip_blocks` on, Python string methods
//! (`.strip()`, `.startswith()`) through minijinja-contrib's pycompat, `raise_exception`
//! failing the render, and `messages`, the special-token strings and `add_generation_prompt`
//! in the context.

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};

use super::{PromptError, Turn};

/// The one template's name in its environment.
const NAME: &str = "chat";

/// A compiled chat template and the special-token strings its context carries.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from (`DIR/chat_template.jinja`, or `DIR/tokenizer_config.json`), for
    /// errors at request time.
    pub(super) origin: String,
    /// `bos_token`, `eos_token`, ... as tokenizer_config.json names them.
    special: Vec<(String, String)>,
}

impl ChatTemplate {
    /// Compile `source`; the error text is minijinja's (the caller names the file).
    pub(super) fn compile(
        source: String,
        origin: String,
        special: Vec<(String, String)>,
    ) -> Result<Self, Error> {
        let mut env = Environment::new();
        // transformers compiles chat templates with trim_blocks and lstrip_blocks; without
        // them the newlines after `{% ... %}` tags would land in the prompt.
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(NAME, source)?;
        Ok(ChatTemplate {
            env,
            origin,
            special,
        })
    }

    /// The prompt text of `turns`, ending with the generation prompt.
    pub(super) fn render(&self, turns: &[Turn<'_>]) -> Result<String, PromptError> {
        let failed = |error: Error| PromptError::Template {
            template: self.origin.clone(),
            message: describe(&error),
        };
        // Each message a map (`message['role']`, `message.content`), keys in this order for
        // `tojson` (preserve_order).
        let messages: Value = turns
            .iter()
            .map(|t| {
                [
                    ("role", Value::from(t.role)),
                    ("content", Value::from(t.content)),
                ]
                .into_iter()
                .collect::<Value>()
            })
            .collect();
        let mut context: Vec<(String, Value)> = self
            .special
            .iter()
            .map(|(name, text)| (name.clone(), Value::from(text.as_str())))
            .collect();
        context.push(("messages".into(), messages));
        context.push(("add_generation_prompt".into(), Value::from(true)));
        let context: Value = context.into_iter().collect();
        self.env
            .get_template(NAME)
            .map_err(failed)?
            .render(context)
            .map_err(failed)
    }
}

/// `raise_exception(message)`, which HF templates call on input they refuse (roles out of
/// order, a system message where none is allowed): the render fails with the message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// An error with the chain minijinja keeps (a failing include, a raised message) and the line.
pub(super) fn describe(error: &Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
