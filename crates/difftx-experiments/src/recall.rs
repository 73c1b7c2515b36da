//! Multi-query associative recall ("MQAR", the Zoology benchmark of in-context retrieval): a
//! document lists P key-value pairs `k:v` (optionally with real-text filler words between them),
//! then queries every key once in random order (`k:` followed by its value). A query counts as
//! correct when the model's greedy prediction of every value token is right, reading all queries
//! of a document in one teacher-forced forward pass. Accuracy per pair count P, as JSON and a
//! heatmap. Difficulty knobs: P, the key and value shapes ([`PairFormat`]) and the filler.

use crate::mixture::{clean_text, read_corpus, recall_document, PairFormat};
use crate::needle::{cell_seed, draw_heatmaps, load, Panel};
use anyhow::{bail, Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use difftx_core::model::Model;
use difftx_core::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecallOptions {
    /// Numbers of key-value pairs per document (one accuracy each).
    pub pair_counts: Vec<usize>,
    /// Documents per pair count.
    pub documents: usize,
    /// Real-text words after each pair, inclusive range ((0, 0): none).
    pub filler: (usize, usize),
    pub pairs: PairFormat,
    pub seed: u64,
    /// Text of the filler words; None = the bundled corpus.
    pub haystack: Option<PathBuf>,
}

impl Default for RecallOptions {
    fn default() -> Self {
        RecallOptions {
            pair_counts: vec![2, 4, 8],
            documents: 24,
            filler: (0, 0),
            pairs: PairFormat::default(),
            seed: 0,
            haystack: None,
        }
    }
}

impl RecallOptions {
    pub fn validate(&self) -> Result<()> {
        self.pairs.validate()?;
        if self.pair_counts.is_empty() || self.documents == 0 {
            bail!("recall: pair counts and documents must be non-empty / positive");
        }
        if let Some(&p) = self.pair_counts.iter().find(|&&p| p == 0 || p > self.pairs.key_space()) {
            bail!("recall: {p} pairs need 1..={} distinct keys for this key format", self.pairs.key_space());
        }
        if self.filler.0 > self.filler.1 {
            bail!("recall: filler range {:?} is empty", self.filler);
        }
        Ok(())
    }
}

/// A document as token ids, with where each query's value tokens sit.
pub struct RecallPrompt {
    pub ids: Vec<u32>,
    /// (position of the value's first token in `ids`, the value's tokens) per query.
    pub answers: Vec<(usize, Vec<u32>)>,
}

/// Tokenises a recall document piece by piece so the value positions are exact for any
/// tokenizer (the context, then each query's prefix and value).
pub fn recall_prompt(tok: &Tokenizer, doc: &crate::mixture::RecallDocument) -> Result<RecallPrompt> {
    let mut ids = tok.encode(&doc.context)?;
    let mut answers = Vec::with_capacity(doc.queries.len());
    for (prefix, value) in &doc.queries {
        ids.extend(tok.encode(prefix)?);
        let v = tok.encode(value)?;
        answers.push((ids.len(), v.clone()));
        ids.extend(v);
    }
    Ok(RecallPrompt { ids, answers })
}

/// Greedy next-token predictions at every position: `ids -> argmax ids` (same length).
pub type Predictor<'a> = dyn FnMut(&[u32]) -> Result<Vec<u32>> + 'a;

/// The model's greedy next-token prediction at every position of `ids` (one forward pass).
pub fn greedy_predictions(model: &Model, ids: &[u32]) -> Result<Vec<u32>> {
    let x = Tensor::new(ids, model.device())?.unsqueeze(0)?;
    let logits = model.forward(&x, None)?.i(0)?.to_dtype(DType::F32)?;
    Ok(logits.argmax(1)?.to_vec1::<u32>()?)
}

/// Recall accuracy per pair count with any predictor (the model in [`run_recall`], oracles in
/// tests). Documents that do not fit `max_seq_len` tokens are not scored; a pair count none of
/// whose documents fit gets a null accuracy. Errors if nothing fits.
pub fn evaluate_recall(
    tok: &Tokenizer,
    opts: &RecallOptions,
    max_seq_len: usize,
    predict: &mut Predictor<'_>,
) -> Result<serde_json::Value> {
    opts.validate()?;
    let text = if opts.filler.1 > 0 { clean_text(&read_corpus(opts.haystack.as_deref())?) } else { String::new() };
    let words: Vec<&str> = text.split(' ').filter(|w| !w.is_empty()).collect();
    let (mut all_c, mut all_t) = (0usize, 0usize);
    let mut rows = Vec::new();
    for (pi, &p) in opts.pair_counts.iter().enumerate() {
        let (mut c, mut t, mut skipped) = (0usize, 0usize, 0usize);
        for d in 0..opts.documents {
            let mut rng = StdRng::seed_from_u64(cell_seed(opts.seed, &[97, pi as u64, d as u64]));
            let doc = recall_document(&words, &opts.pairs, p, opts.filler, &mut rng);
            let prompt = recall_prompt(tok, &doc)?;
            // the last value token is a target, never an input
            if prompt.ids.len() > max_seq_len + 1 {
                skipped += 1;
                continue;
            }
            let input = &prompt.ids[..prompt.ids.len() - 1];
            let pred = predict(input)?;
            if pred.len() != input.len() {
                bail!("recall: the predictor returned {} predictions for {} tokens", pred.len(), input.len());
            }
            for (pos, value) in &prompt.answers {
                t += 1;
                if value.iter().enumerate().all(|(j, &v)| pred[pos + j - 1] == v) {
                    c += 1;
                }
            }
        }
        all_c += c;
        all_t += t;
        let acc = if t > 0 { Some(c as f64 / t as f64) } else { None };
        rows.push(serde_json::json!({"pairs": p, "accuracy": acc, "queries": t, "skipped_documents": skipped}));
    }
    if all_t == 0 {
        bail!("recall: no document fits the model's context of {max_seq_len} tokens; use fewer pairs");
    }
    Ok(serde_json::json!({
        "pair_counts": opts.pair_counts,
        "by_pairs": rows,
        "mean_accuracy": all_c as f64 / all_t as f64,
        "chance_accuracy": opts.pairs.chance(),
    }))
}

/// Runs the recall measurement on a model; writes `recall.json` and `recall.png`.
pub fn run_recall(model_dir: &Path, opts: &RecallOptions, out_dir: &Path) -> Result<serde_json::Value> {
    opts.validate()?;
    let (model, tok) = load(model_dir)?;
    let res = evaluate_recall(&tok, opts, model.config().max_seq_len, &mut |ids| greedy_predictions(&model, ids))?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let panel = recall_panel(&res, model.config().family.as_str());
    draw_heatmaps(&out_dir.join("recall.png"), "associative recall accuracy by number of pairs", &[panel], 0.0, 1.0)?;
    let v = serde_json::json!({
        "instrument": "recall",
        "model": model_dir.display().to_string(),
        "family": model.config().family.as_str(),
        "options": opts,
        "by_pairs": res["by_pairs"],
        "mean_accuracy": res["mean_accuracy"],
        "chance_accuracy": res["chance_accuracy"],
    });
    std::fs::write(out_dir.join("recall.json"), serde_json::to_string_pretty(&v)?)?;
    Ok(v)
}

/// One heatmap row (accuracy per pair count) from the JSON of [`evaluate_recall`].
pub(crate) fn recall_panel(v: &serde_json::Value, title: &str) -> Panel {
    let rows = v["by_pairs"].as_array().cloned().unwrap_or_default();
    Panel {
        title: title.to_string(),
        rows: vec!["accuracy".into()],
        cols: rows.iter().map(|r| format!("P={}", r["pairs"])).collect(),
        values: vec![rows.iter().map(|r| r["accuracy"].as_f64()).collect()],
    }
}
