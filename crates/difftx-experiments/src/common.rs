//! Shared helpers of the instruments: loading a model with its tokenizer, reading evaluation
//! text and cutting it into windows, and writing results.

use anyhow::{bail, Context, Result};
use difftx_core::checkpoint;
use difftx_core::model::Model;
use difftx_core::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// A model ready to run on the CPU, its tokenizer and the folder it was loaded from (a run folder
/// resolves to its latest checkpoint).
pub fn load_model_and_tokenizer(model_dir: &Path) -> Result<(Model, Tokenizer, PathBuf)> {
    let dir = checkpoint::resolve_model_dir(model_dir)?;
    let model = checkpoint::load_runnable(&dir, &candle_core::Device::Cpu)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let tok = Tokenizer::from_model_dir(&dir)?;
    if tok.vocab_size() > model.config().vocab_size {
        bail!(
            "{}: tokenizer has {} tokens but the model only {}; wrong tokenizer for this model",
            dir.display(),
            tok.vocab_size(),
            model.config().vocab_size
        );
    }
    Ok((model, tok, dir))
}

/// The evaluation text: `path` (a UTF-8 file) or the bundled corpus. Returns the text and the path
/// it came from.
pub fn read_eval_text(path: Option<&Path>) -> Result<(String, PathBuf)> {
    let path = match path {
        Some(p) => p.to_path_buf(),
        None => difftx_train::data::bundled_corpus()?,
    };
    if !path.is_file() {
        bail!("evaluation text {} does not exist or is not a file", path.display());
    }
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", path.display()))?;
    Ok((text, path))
}

/// Non-overlapping windows of `seq_len + 1` tokens (inputs plus the next token) taken from the
/// END of the token stream (for a model trained on this text that is its validation split), at
/// most `max_tokens` input tokens in all (at least one window). Windows are returned in text order.
pub fn token_windows(tokens: &[u32], seq_len: usize, max_tokens: usize) -> Result<Vec<Vec<u32>>> {
    if seq_len == 0 {
        bail!("sequence length must be at least 1");
    }
    if max_tokens == 0 {
        bail!("token budget must be at least 1");
    }
    let window = seq_len + 1;
    if tokens.len() < window {
        bail!(
            "text too short: {} tokens, but one window of {seq_len} tokens needs {window}; give more text or a shorter sequence length",
            tokens.len()
        );
    }
    let available = (tokens.len() - 1) / seq_len;
    let wanted = max_tokens.div_ceil(seq_len).max(1);
    let n = available.min(wanted);
    // Windows share their boundary token (target of one = first input of the next), ending at the
    // last token.
    let start0 = tokens.len() - 1 - n * seq_len;
    Ok((0..n).map(|i| tokens[start0 + i * seq_len..start0 + i * seq_len + window].to_vec()).collect())
}

/// Tokenises the evaluation text and cuts it into windows of the model's context (or `seq_len`
/// when given, capped at the context).
pub fn eval_windows(
    model: &Model,
    tok: &Tokenizer,
    text: &str,
    seq_len: Option<usize>,
    max_tokens: usize,
) -> Result<(Vec<Vec<u32>>, usize)> {
    let ctx = model.config().max_seq_len;
    let seq_len = match seq_len {
        Some(0) => bail!("sequence length must be at least 1"),
        Some(s) if s > ctx => bail!("sequence length {s} is longer than the model's context of {ctx} tokens"),
        Some(s) => s,
        None => ctx,
    };
    let tokens = tok.encode(text)?;
    let windows = token_windows(&tokens, seq_len.min(max_tokens.max(1)), max_tokens)?;
    let seq_len = windows[0].len() - 1;
    Ok((windows, seq_len))
}

/// Mean next-token loss (nats) of `model` over windows of equal length, `batch` windows at a time.
pub fn mean_loss(model: &Model, windows: &[Vec<u32>], batch: usize) -> Result<f64> {
    let (batches, seq_len) = difftx_train::eval::windows_to_batches(windows, batch)?;
    difftx_train::eval::mean_loss(model, &batches, seq_len)
}

/// Writes `value` pretty-printed to `out_dir/name` (creating the folder).
pub fn write_json(out_dir: &Path, name: &str, value: &serde_json::Value) -> Result<PathBuf> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let path = out_dir.join(name);
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(&path, text + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// Turns any plotting error into a one-line anyhow error naming the file.
pub fn plot_err<E: std::fmt::Debug>(path: &Path) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("cannot draw {}: {e:?}", path.display())
}
