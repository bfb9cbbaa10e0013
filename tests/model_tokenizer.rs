//! `ModelTokenizer` against the Hugging Face tokenizer: the fixture model folder
//! (tests/fixtures/tiny-llama, the tiny model the live vLLM engine serves) and the ids
//! transformers gave for it (tests/fixtures/expected.json, written by expected.py). Also its
//! decoding, the incremental decoder, and every load and render error.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use prefill_router::http::tokenizer::Turn;
use prefill_router::http::{ApiError, LoadError, ModelTokenizer, PromptError, Tokenizer};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama")
}

fn load() -> ModelTokenizer {
    ModelTokenizer::from_dir(fixture()).expect("the fixture model folder loads")
}

fn cases() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/expected.json");
    let text = std::fs::read_to_string(path).expect("expected.json");
    let json: Value = serde_json::from_str(&text).expect("expected.json is JSON");
    json["cases"].as_array().expect("cases").clone()
}

fn ids(case: &Value) -> Vec<u32> {
    case["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|id| id.as_u64().expect("an id") as u32)
        .collect()
}

/// A case's messages as turns (borrowing from the case).
fn turns(case: &Value) -> Vec<Turn<'_>> {
    case["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| Turn {
            role: m["role"].as_str().expect("role"),
            content: m["content"].as_str().expect("content"),
        })
        .collect()
}

#[test]
fn ids_are_the_hugging_face_tokenizers_for_every_case() {
    let model = load();
    let tokenizer = Tokenizer::Model(Arc::new(load()));
    let cases = cases();
    assert!(cases.len() >= 10);
    for case in &cases {
        let expected = ids(case);
        if let Some(prompt) = case["prompt"].as_str() {
            assert_eq!(model.encode_prompt(prompt).unwrap(), expected, "{prompt:?}");
            assert_eq!(tokenizer.encode_prompt(prompt).unwrap(), expected);
        } else {
            let turns = turns(case);
            assert_eq!(
                model.chat_text(&turns).unwrap(),
                case["text"].as_str().unwrap()
            );
            assert_eq!(model.encode_chat(&turns).unwrap(), expected, "{turns:?}");
            assert_eq!(tokenizer.encode_chat(&turns).unwrap(), expected);
        }
    }
}

#[test]
fn decoding_gives_the_text_back_without_special_tokens() {
    let model = load();
    for case in cases() {
        let Some(prompt) = case["prompt"].as_str() else {
            continue;
        };
        let decoded = model.decode(&ids(&case));
        if prompt.contains("<s>") {
            // Special tokens are skipped, the rest stays.
            assert!(
                !decoded.contains("<s>") && !decoded.contains("</s>"),
                "{decoded:?}"
            );
            assert!(decoded.contains("special token text"), "{decoded:?}");
        } else {
            assert_eq!(decoded, prompt);
        }
    }
    // Ids the vocabulary lacks are skipped, not a panic.
    assert_eq!(model.decode(&[u32::MAX, 43]), model.decode(&[43]));
}

#[test]
fn incremental_decoding_equals_the_full_decode_and_never_splits_a_character() {
    let model = Arc::new(load());
    let tokenizer = Tokenizer::Model(Arc::clone(&model));
    let prompt = model.encode_prompt("Say something:").unwrap();
    for case in cases() {
        let ids = ids(&case);
        let full = model.decode(&ids);
        for batch in [1, 2, 3, 7] {
            let mut detokenizer = tokenizer.detokenizer(&prompt);
            let mut streamed = String::new();
            let chunks: Vec<&[u32]> = ids.chunks(batch).collect();
            for (i, chunk) in chunks.iter().enumerate() {
                let text = detokenizer.push(chunk, i + 1 == chunks.len());
                // A multi-byte character split over tokens is held back, not sent as U+FFFD.
                assert!(!text.contains('\u{FFFD}'), "{text:?} of {ids:?}");
                streamed.push_str(&text);
            }
            assert_eq!(streamed, full, "batches of {batch}");
        }
        assert_eq!(tokenizer.detokenizer(&prompt).whole(&ids), full);
    }
    // A reply cut inside a character: held back, then written as U+FFFD at its end, as the
    // full decode writes it.
    let emoji = model.encode_prompt("🙂").unwrap();
    assert!(emoji.len() > 1, "the emoji is several byte tokens");
    let cut = &emoji[..emoji.len() - 1];
    let mut detokenizer = tokenizer.detokenizer(&[]);
    assert_eq!(detokenizer.push(cut, false), "");
    assert_eq!(detokenizer.push(&[], true), model.decode(cut));
}

/// A copy of the fixture folder to break.
fn copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(fixture().join(file), dir.path().join(file)).unwrap();
    }
    dir
}

fn load_error(dir: &Path) -> LoadError {
    ModelTokenizer::from_dir(dir).expect_err("the folder must not load")
}

#[test]
fn every_load_error_names_the_file() {
    let missing = Path::new("/nonexistent/model");
    let error = load_error(missing);
    assert!(matches!(error, LoadError::NoDir { .. }), "{error:?}");
    assert!(error.to_string().contains("/nonexistent/model"), "{error}");

    let dir = copy();
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let error = load_error(dir.path());
    assert!(matches!(error, LoadError::Read { .. }), "{error:?}");
    assert!(error.to_string().contains("tokenizer.json"), "{error}");

    let dir = copy();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 7}").unwrap();
    let error = load_error(dir.path());
    assert!(matches!(error, LoadError::Tokenizer { .. }), "{error:?}");
    assert!(error.to_string().contains("tokenizer.json"), "{error}");

    let dir = copy();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    let error = load_error(dir.path());
    assert!(matches!(error, LoadError::Config { .. }), "{error:?}");
    assert!(
        error.to_string().contains("tokenizer_config.json"),
        "{error}"
    );

    let dir = copy();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}{{ m",
    )
    .unwrap();
    let error = load_error(dir.path());
    assert!(matches!(error, LoadError::Template { .. }), "{error:?}");
    assert!(error.to_string().contains("chat_template.jinja"), "{error}");

    // The template in tokenizer_config.json: a bad one names that file.
    let dir = copy();
    std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
    let config = r#"{"bos_token": "<s>", "chat_template": "{% if %}"}"#;
    std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
    let error = load_error(dir.path());
    assert!(matches!(error, LoadError::Template { .. }), "{error:?}");
    assert!(
        error.to_string().contains("tokenizer_config.json"),
        "{error}"
    );

    let config = r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#;
    std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
    let error = load_error(dir.path());
    assert!(matches!(error, LoadError::Config { .. }), "{error:?}");
    assert!(error.to_string().contains("default"), "{error}");
}

/// The fixture's tokenizer with `config` as tokenizer_config.json and no template file.
fn with_config(config: Value) -> (tempfile::TempDir, ModelTokenizer) {
    let dir = copy();
    std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let model = ModelTokenizer::from_dir(dir.path()).unwrap();
    (dir, model)
}

#[test]
fn hugging_face_template_idioms_render() {
    // Python string methods, loop controls, tojson, the special tokens, an AddedToken-shaped
    // eos, and the list-of-named-templates form.
    let template = "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
        {% if m.role.startswith('sys') %}[{{ m.content.strip() | upper }}]{% else %}{{ m | tojson }}{% endif %}\
        {% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}";
    let (_dir, model) = with_config(serde_json::json!({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "__type": "AddedToken"},
        "chat_template": [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}],
    }));
    let turns = [
        Turn {
            role: "system",
            content: "  be terse ",
        },
        Turn {
            role: "user",
            content: "hi \"there\" <&'>",
        },
        Turn {
            role: "user",
            content: "dropped by break",
        },
    ];
    assert_eq!(
        model.chat_text(&turns).unwrap(),
        r#"<s>[BE TERSE]{"role": "user", "content": "hi \"there\" <&'>"}</s>"#
    );
}

#[test]
fn tojson_writes_what_python_json_dumps_writes() {
    let (_dir, model) = with_config(serde_json::json!({
        "chat_template": "{{ {'b': [1, 2.5, none, true], 'a': 'x'} | tojson }}|{{ {'a': [1, 2]} | tojson(indent=2) }}",
    }));
    let turns = [Turn {
        role: "user",
        content: "x",
    }];
    // json.dumps({"b": [1, 2.5, None, True], "a": "x"}) and json.dumps({"a": [1, 2]}, indent=2).
    assert_eq!(
        model.chat_text(&turns).unwrap(),
        "{\"b\": [1, 2.5, null, true], \"a\": \"x\"}|{\n  \"a\": [\n    1,\n    2\n  ]\n}"
    );
}

#[test]
fn a_failing_template_is_a_typed_400_not_a_panic() {
    let (_dir, model) = with_config(serde_json::json!({
        "chat_template": "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
    }));
    let system = [Turn {
        role: "system",
        content: "x",
    }];
    let error = model.encode_chat(&system).unwrap_err();
    assert!(matches!(error, PromptError::Template { .. }), "{error:?}");
    assert!(
        error
            .to_string()
            .contains("Conversation must start with user"),
        "{error}"
    );
    assert!(
        error.to_string().contains("tokenizer_config.json"),
        "{error}"
    );
    let api = ApiError::from(error);
    assert_eq!(
        (api.status.as_u16(), api.code),
        (400, "chat_template_error")
    );
    assert_eq!(
        model
            .chat_text(&[Turn {
                role: "user",
                content: "x"
            }])
            .unwrap(),
        "ok"
    );

    // No template at all: completions work, chat is refused.
    let (_dir, bare) = with_config(serde_json::json!({}));
    assert!(!bare.has_chat_template());
    assert!(bare.encode_prompt("hi").is_ok());
    let error = bare.encode_chat(&system).unwrap_err();
    assert!(matches!(error, PromptError::NoTemplate { .. }), "{error:?}");
}

/// Answers of the live vLLM engine (0.32.0, serving tiny-llama) to `POST /tokenize`, recorded
/// by hand with curl: ours must stay equal to them.
#[test]
fn ids_equal_the_recorded_answers_of_the_live_engine() {
    let model = load();
    assert_eq!(
        model.encode_prompt("Hello, world! <s> héllo").unwrap(),
        [43, 72, 79, 361, 15, 317, 274, 477, 4, 224, 1, 417, 131, 106, 79, 361]
    );
    let chat = [
        Turn {
            role: "system",
            content: "Be brief.",
        },
        Turn {
            role: "user",
            content: "Hi",
        },
    ];
    assert_eq!(
        model.encode_chat(&chat).unwrap(),
        [
            1, 86, 92, 278, 72, 80, 29, 748, 72, 299, 394, 72, 73, 17, 202, 1, 88, 499, 29, 224,
            43, 76, 202, 68, 335, 76, 498, 87, 29, 224
        ]
    );
}
