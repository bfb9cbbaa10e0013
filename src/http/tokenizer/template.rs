//! A Hugging Face chat template (Jinja) compiled with minijinja, rendered the way transformers'
//! `apply_chat_template` does: `trim_blocks` and `lstrip_blocks` on, Python string methods
//! (`.strip()`, `.startswith()`) through minijinja-contrib's pycompat, `raise_exception`
//! failing the render, and `messages`, the special-token strings and `add_generation_prompt`
//! in the context.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, ValueKind};
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
        env.add_filter("tojson", tojson);
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
            .map(|t| Value::from_pairs([("role", t.role), ("content", t.content)]))
            .collect();
        let mut context: Vec<(String, Value)> = self
            .special
            .iter()
            .map(|(name, text)| (name.clone(), Value::from(text.as_str())))
            .collect();
        context.push(("messages".into(), messages));
        context.push(("add_generation_prompt".into(), Value::from(true)));
        let context = Value::from_pairs(context);
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

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=indent)`, so
/// `", "` and `": "` separators and no HTML escaping (minijinja's own escapes `<`, `>`, `&`
/// and `'`, which would change the prompt of tool-calling templates).
fn tojson(value: &Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(n) => Some(n),
        None => indent,
    };
    // Accepted as transformers' filter does; their defaults are what is written here anyway.
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), Error> {
    // Python's layout: items on their own lines with `indent` spaces per level, `,` at line
    // ends; without an indent, one line with `", "`.
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&value.to_string()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                push_json_string(out, &key.to_string());
                out.push_str(": ");
                write_json(out, &value.get_item(key)?, indent, depth + 1)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => push_json_string(out, &value.to_string()),
    }
    Ok(())
}

/// A JSON string with Python's escapes under `ensure_ascii=False`: quotes, backslashes and
/// control characters only.
fn push_json_string(out: &mut String, text: &str) {
    out.push_str(&serde_json::Value::from(text).to_string());
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
