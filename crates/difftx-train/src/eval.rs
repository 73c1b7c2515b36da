//! Evaluation: the one mean-loss loop of the workspace (used by the trainer's validation, the
//! `eval` command and the experiments) and the text report built on it (loss, perplexity, bits
//! per byte).

use crate::data::TokenDataset;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use difftx_core::model::Model;
use difftx_core::tokenizer::Tokenizer;
use serde::Serialize;

/// One evaluation batch: `(inputs, targets, rows)`, inputs and targets each `rows * seq_len`
/// tokens, row-major (the format of [`TokenDataset::val_batches`]).
pub type Batch = (Vec<u32>, Vec<u32>, usize);

/// Mean next-token cross-entropy (nats per token) of `model` over `batches` of sequence length
/// `seq_len`, every target token weighted equally.
pub fn mean_loss(model: &Model, batches: &[Batch], seq_len: usize) -> Result<f64> {
    if batches.is_empty() {
        bail!("no evaluation batches: the text is shorter than one sequence");
    }
    let dev = model.device();
    let (mut total, mut count) = (0.0, 0usize);
    for (x, y, rows) in batches {
        let xs = Tensor::from_slice(x, (*rows, seq_len), dev)?;
        let ys = Tensor::from_slice(y, (*rows, seq_len), dev)?;
        let loss = Model::loss(&model.forward(&xs, None)?, &ys)?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        total += loss * (*rows * seq_len) as f64;
        count += rows * seq_len;
    }
    Ok(total / count as f64)
}

/// Windows of `seq_len + 1` tokens (inputs plus the next token) grouped `batch` to a batch.
/// All windows must have the same length.
pub fn windows_to_batches(windows: &[Vec<u32>], batch: usize) -> Result<(Vec<Batch>, usize)> {
    let Some(first) = windows.first() else { bail!("no evaluation windows") };
    let seq_len = first.len().saturating_sub(1);
    if seq_len == 0 || windows.iter().any(|w| w.len() != seq_len + 1) {
        bail!("evaluation windows must all have the same length of at least 2 tokens");
    }
    let batches = windows
        .chunks(batch.max(1))
        .map(|chunk| {
            let x = chunk.iter().flat_map(|w| w[..seq_len].iter().copied()).collect();
            let y = chunk.iter().flat_map(|w| w[1..].iter().copied()).collect();
            (x, y, chunk.len())
        })
        .collect();
    Ok((batches, seq_len))
}

/// What [`evaluate_text`] measured.
#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    /// Target tokens the loss was averaged over.
    pub tokens_evaluated: usize,
    /// Mean next-token cross-entropy, nats per token.
    pub loss: f64,
    /// exp(loss).
    pub perplexity: f64,
    /// loss / ln 2 / bytes_per_token: bits per UTF-8 byte of the text.
    pub bits_per_byte: f64,
    /// UTF-8 bytes of the whole text per token of the whole text.
    pub bytes_per_token: f64,
}

/// Evaluates `model` on `texts`: each text is tokenised and the tokens joined into one stream
/// (nothing inserted between texts), cut into non-overlapping windows of `seq_len` inputs from
/// the start, `batch` windows to a batch, at most `max_batches` batches. Bits per byte use the
/// byte and token counts of the whole text.
pub fn evaluate_text(
    model: &Model,
    tok: &Tokenizer,
    texts: &[String],
    seq_len: usize,
    batch: usize,
    max_batches: usize,
) -> Result<EvalReport> {
    let ctx = model.config().max_seq_len;
    if seq_len == 0 {
        bail!("sequence length must be at least 1");
    }
    if seq_len > ctx {
        bail!("sequence length {seq_len} exceeds the model's context {ctx}");
    }
    let bytes: usize = texts.iter().map(|t| t.len()).sum();
    let mut tokens = Vec::new();
    for t in texts {
        tokens.extend(tok.encode(t)?);
    }
    if tokens.len() < seq_len + 1 {
        bail!("the text has {} tokens, shorter than one sequence of {}", tokens.len(), seq_len + 1);
    }
    let bytes_per_token = bytes as f64 / tokens.len() as f64;
    let batches = TokenDataset { train: Vec::new(), val: tokens, doc_starts: Vec::new() }.val_batches(
        batch,
        seq_len,
        max_batches,
    );
    let loss = mean_loss(model, &batches, seq_len)?;
    Ok(EvalReport {
        tokens_evaluated: batches.iter().map(|b| b.2 * seq_len).sum(),
        loss,
        perplexity: loss.exp(),
        bits_per_byte: loss / std::f64::consts::LN_2 / bytes_per_token,
        bytes_per_token,
    })
}
