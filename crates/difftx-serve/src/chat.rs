//! Chat messages to a prompt: the model folder's chat template, or a plain one.
//!
//! A Hugging Face folder may carry a Jinja chat template in `tokenizer_config.json`
//! (`chat_template`); it is rendered with `messages`, `add_generation_prompt = true`,
//! `bos_token` and `eos_token`, as transformers' `apply_chat_template` does. Without one (every
//! difftx run) the plain template is used:
//!
//! ```text
//! System: {system message}
//! User: {user message}
//! Assistant: {assistant message}
//! User: {user message}
//! Assistant:
//! ```
//!
//! one line per message, and generation stops at a new line starting `User:`.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One chat message (`role`: system, user, assistant or tool).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// How a folder's model turns messages into a prompt.
#[derive(Debug, Clone)]
pub enum ChatTemplate {
    Jinja { source: String, bos_token: String, eos_token: String },
    Plain,
}

/// File that may hold a Hugging Face chat template.
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";

impl ChatTemplate {
    /// The template of a model folder: `tokenizer_config.json`'s `chat_template` if there is
    /// one, else the plain template.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join(TOKENIZER_CONFIG);
        if !path.is_file() {
            return Ok(ChatTemplate::Plain);
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let cfg: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        let source = match &cfg["chat_template"] {
            serde_json::Value::String(s) => s.clone(),
            // A list of named templates: the one called "default".
            serde_json::Value::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_string)
                .with_context(|| format!("{} lists chat templates but none named 'default'", path.display()))?,
            _ => return Ok(ChatTemplate::Plain),
        };
        // Special tokens are written as a string or as {"content": ...}.
        let token = |key: &str| match &cfg[key] {
            serde_json::Value::String(s) => s.clone(),
            v => v["content"].as_str().unwrap_or_default().to_string(),
        };
        let template = ChatTemplate::Jinja { source, bos_token: token("bos_token"), eos_token: token("eos_token") };
        // A template that does not render is an error at start-up, not on the first request.
        template
            .render(&[Message { role: "user".into(), content: "hi".into() }])
            .with_context(|| format!("the chat template of {} does not render", path.display()))?;
        Ok(template)
    }

    /// The prompt for `messages`, ending where the assistant's answer starts.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        match self {
            ChatTemplate::Plain => {
                let mut out = String::new();
                for m in messages {
                    let who = match m.role.as_str() {
                        "system" | "developer" => "System",
                        "user" => "User",
                        "assistant" => "Assistant",
                        "tool" => "Tool",
                        other => bail!("unknown message role '{other}' (expected system, user, assistant or tool)"),
                    };
                    out.push_str(&format!("{who}: {}\n", m.content));
                }
                out.push_str("Assistant:");
                Ok(out)
            }
            ChatTemplate::Jinja { source, bos_token, eos_token } => {
                let mut env = minijinja::Environment::new();
                env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
                env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
                    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
                });
                let ctx = minijinja::context! {
                    messages => messages,
                    add_generation_prompt => true,
                    bos_token => bos_token,
                    eos_token => eos_token,
                };
                env.render_str(source, ctx).map_err(|e| anyhow::anyhow!("chat template: {e}"))
            }
        }
    }

    /// Stop strings every chat request gets (the plain template's next user turn).
    pub fn stop_strings(&self) -> Vec<String> {
        match self {
            ChatTemplate::Plain => vec!["\nUser:".to_string()],
            ChatTemplate::Jinja { .. } => Vec::new(),
        }
    }

    /// Whether this is the plain template (the folder has no chat template).
    pub fn is_plain(&self) -> bool {
        matches!(self, ChatTemplate::Plain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<Message> {
        vec![
            Message { role: "system".into(), content: "Be brief.".into() },
            Message { role: "user".into(), content: "Hello".into() },
        ]
    }

    #[test]
    fn the_plain_template_is_one_line_per_message() {
        let p = ChatTemplate::Plain.render(&msgs()).unwrap();
        assert_eq!(p, "System: Be brief.\nUser: Hello\nAssistant:");
        assert!(ChatTemplate::Plain.render(&[Message { role: "robot".into(), content: "x".into() }]).is_err());
    }

    #[test]
    fn a_folders_jinja_template_is_rendered_like_transformers() {
        let dir = tempfile::tempdir().unwrap();
        let template = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'].strip() }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let cfg = serde_json::json!({"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}});
        std::fs::write(dir.path().join(TOKENIZER_CONFIG), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
        let p = t.render(&msgs()).unwrap();
        assert_eq!(p, "<s><|system|>Be brief.</s><|user|>Hello</s><|assistant|>");
        // raise_exception surfaces as an error.
        let cfg = serde_json::json!({"chat_template": "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}x"});
        std::fs::write(dir.path().join(TOKENIZER_CONFIG), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
        let err = t.render(&msgs()).unwrap_err().to_string();
        assert!(err.contains("one message only"), "{err}");
    }

    #[test]
    fn a_folder_without_a_template_uses_the_plain_one() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_plain());
        std::fs::write(dir.path().join(TOKENIZER_CONFIG), r#"{"bos_token": "<s>"}"#).unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_plain());
    }
}
