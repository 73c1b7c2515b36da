//! Training data: reading text from disk and turning it into batches of token windows.
//!
//! This module owns:
//! - [`load_texts`]: reading a text file, a JSONL file, or a folder of `.txt` files;
//! - [`TokenDataset`]: tokenising those texts into one stream, the deterministic
//!   train/validation split, random training windows and fixed validation batches.
//!
//! A window is `seq_len + 1` consecutive tokens; its first `seq_len` tokens are the input
//! and its last `seq_len` the targets (the input shifted left by one).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use difftx_core::tokenizer::Tokenizer;

/// Read training text from `path`:
/// - a `.jsonl` or `.json` file: one JSON object per line, the string field `jsonl_field`
///   of each (blank lines are skipped);
/// - any other file: its whole content as one text;
/// - a folder: every `*.txt` file in it, recursively, in path order.
///
/// Empty texts are dropped. Errors on a missing path, no text at all, a file that is not
/// UTF-8, and a JSONL line that is not JSON or lacks the string field (with file and line).
pub fn load_texts(path: &Path, jsonl_field: &str) -> anyhow::Result<Vec<String>> {
    if !path.exists() {
        bail!("training data {} does not exist", path.display());
    }
    let texts = if path.is_dir() {
        let mut files = Vec::new();
        collect_txt_files(path, &mut files)?;
        files.sort();
        if files.is_empty() {
            bail!("folder {} contains no .txt files", path.display());
        }
        let mut texts = Vec::with_capacity(files.len());
        for f in &files {
            texts.push(read_text(f)?);
        }
        texts
    } else if has_json_extension(path) {
        read_jsonl(path, jsonl_field)?
    } else {
        vec![read_text(path)?]
    };
    let texts: Vec<String> = texts.into_iter().filter(|t| !t.is_empty()).collect();
    if texts.is_empty() {
        bail!("no training text found in {} (it is empty)", path.display());
    }
    Ok(texts)
}

fn has_json_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("json"))
}

fn collect_txt_files(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    let entries = fs::read_dir(dir).with_context(|| format!("could not list folder {}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("could not list folder {}", dir.display()))?;
        let p = entry.path();
        let ty = entry.file_type().with_context(|| format!("could not inspect {}", p.display()))?;
        // Symlinked folders are not followed (no cycles); symlinked files are read.
        if ty.is_dir() {
            collect_txt_files(&p, out)?;
        } else if p.is_file() && p.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("txt")) {
            out.push(p);
        }
    }
    Ok(())
}

fn read_text(path: &Path) -> anyhow::Result<String> {
    let bytes = fs::read(path).with_context(|| format!("could not read {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

fn read_jsonl(path: &Path, field: &str) -> anyhow::Result<Vec<String>> {
    let content = read_text(path)?;
    let mut texts = Vec::new();
    for (i, line) in content.lines().enumerate() {
        let line_no = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{}:{line_no}: not a JSON object ({e})", path.display()))?;
        match value.get(field) {
            Some(serde_json::Value::String(s)) => texts.push(s.clone()),
            Some(_) => bail!("{}:{line_no}: field \"{field}\" is not a string", path.display()),
            None => bail!("{}:{line_no}: no field \"{field}\"", path.display()),
        }
    }
    Ok(texts)
}

/// Where training windows may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WindowStart {
    /// Any token of the training stream (plain language-model training).
    #[default]
    Anywhere,
    /// A document start (and every `seq_len` tokens inside a document longer than a window), so
    /// that a short document is never cut: a retrieval question always sees its context.
    DocumentStart,
}

/// A tokenised corpus split into a training and a validation stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenDataset {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    /// Offsets in `train` where a window may start under [`WindowStart::DocumentStart`]: each
    /// document's first token and every `seq_len` tokens after it inside the document, kept
    /// when a whole window fits. Empty for a dataset not built from documents.
    pub doc_starts: Vec<usize>,
}

impl TokenDataset {
    /// Tokenise each text and join them into one stream, with the tokens of `"\n"` between
    /// texts so documents do not run into each other. The last `val_fraction` of the stream
    /// (at least `seq_len + 1` tokens, and leaving at least `seq_len + 1` for training) is
    /// validation; the rest, in order, is training.
    ///
    /// Errors if there are fewer than `2 * (seq_len + 1)` tokens, if `seq_len` is 0, or if
    /// `val_fraction` is not in `[0, 1)`.
    pub fn build(texts: &[String], tok: &Tokenizer, seq_len: usize, val_fraction: f64) -> anyhow::Result<Self> {
        if seq_len == 0 {
            bail!("sequence length must be at least 1");
        }
        if !(0.0..1.0).contains(&val_fraction) {
            bail!("validation fraction {val_fraction} must be at least 0 and below 1");
        }
        let sep = tok.encode("\n")?;
        let mut tokens = Vec::new();
        let mut docs = Vec::with_capacity(texts.len());
        for (i, text) in texts.iter().enumerate() {
            if i > 0 {
                tokens.extend_from_slice(&sep);
            }
            let start = tokens.len();
            tokens.extend(tok.encode(text)?);
            docs.push(start..tokens.len());
        }
        let window = seq_len + 1;
        let n = tokens.len();
        if n < 2 * window {
            bail!(
                "text shorter than one sequence: {n} tokens, but sequence length {seq_len} needs \
                 at least {} (one training and one validation window of {window}); \
                 use more text or a shorter sequence length",
                2 * window
            );
        }
        let val_len = ((n as f64 * val_fraction).ceil() as usize).clamp(window, n - window);
        let val = tokens.split_off(n - val_len);
        let train_len = tokens.len();
        let doc_starts =
            docs.into_iter().flat_map(|d| d.step_by(seq_len)).filter(|&s| s + window <= train_len).collect();
        Ok(TokenDataset { train: tokens, val, doc_starts })
    }

    /// A batch of `batch` training windows of `seq_len + 1` tokens, at offsets drawn
    /// uniformly from `rng`. Returns `(inputs, targets)`, each `batch * seq_len` long,
    /// row-major; row `r` of targets is row `r` of inputs shifted left by one.
    ///
    /// Panics if the training stream is shorter than `seq_len + 1` (impossible for a
    /// dataset built with the same `seq_len`).
    pub fn sample_train_batch(&self, batch: usize, seq_len: usize, rng: &mut impl rand::Rng) -> (Vec<u32>, Vec<u32>) {
        assert!(
            seq_len > 0 && self.train.len() > seq_len,
            "training stream has {} tokens, too short for sequence length {seq_len}",
            self.train.len()
        );
        let max_start = self.train.len() - (seq_len + 1);
        let mut inputs = Vec::with_capacity(batch * seq_len);
        let mut targets = Vec::with_capacity(batch * seq_len);
        for _ in 0..batch {
            let start = rng.random_range(0..=max_start);
            let w = &self.train[start..start + seq_len + 1];
            inputs.extend_from_slice(&w[..seq_len]);
            targets.extend_from_slice(&w[1..]);
        }
        (inputs, targets)
    }

    /// As [`Self::sample_train_batch`], with windows starting at the offsets `starts` allows.
    /// Falls back to any offset when the dataset has no document starts.
    pub fn sample_batch(
        &self,
        batch: usize,
        seq_len: usize,
        starts: WindowStart,
        rng: &mut impl rand::Rng,
    ) -> (Vec<u32>, Vec<u32>) {
        if starts == WindowStart::Anywhere || self.doc_starts.is_empty() {
            return self.sample_train_batch(batch, seq_len, rng);
        }
        let mut inputs = Vec::with_capacity(batch * seq_len);
        let mut targets = Vec::with_capacity(batch * seq_len);
        for _ in 0..batch {
            let start = self.doc_starts[rng.random_range(0..self.doc_starts.len())];
            let w = &self.train[start..start + seq_len + 1];
            inputs.extend_from_slice(&w[..seq_len]);
            targets.extend_from_slice(&w[1..]);
        }
        (inputs, targets)
    }

    /// Validation batches, the same on every call: windows start at `0, seq_len, 2*seq_len,
    /// ...` of the validation stream (inputs do not overlap, so each token after the first is
    /// a target exactly once), grouped `batch` to a batch; the last batch may have fewer rows.
    /// At most `max_batches` batches. Each item is `(inputs, targets, rows)`, each of the
    /// vectors `rows * seq_len` long.
    pub fn val_batches(&self, batch: usize, seq_len: usize, max_batches: usize) -> Vec<(Vec<u32>, Vec<u32>, usize)> {
        if batch == 0 || seq_len == 0 || self.val.len() <= seq_len {
            return Vec::new();
        }
        let n_windows = (self.val.len() - 1) / seq_len;
        let mut out = Vec::new();
        let mut w = 0;
        while w < n_windows && out.len() < max_batches {
            let rows = batch.min(n_windows - w);
            let mut inputs = Vec::with_capacity(rows * seq_len);
            let mut targets = Vec::with_capacity(rows * seq_len);
            for r in 0..rows {
                let start = (w + r) * seq_len;
                let win = &self.val[start..start + seq_len + 1];
                inputs.extend_from_slice(&win[..seq_len]);
                targets.extend_from_slice(&win[1..]);
            }
            out.push((inputs, targets, rows));
            w += rows;
        }
        out
    }
}

/// The bundled default corpus `data/shakespeare.txt`: in the working folder first (a clone's
/// root), then in the source tree this binary was built from.
pub fn bundled_corpus() -> anyhow::Result<PathBuf> {
    let rel = Path::new("data/shakespeare.txt");
    if rel.is_file() {
        return Ok(rel.to_path_buf());
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare.txt");
    if src.is_file() {
        return Ok(src);
    }
    anyhow::bail!(
        "the bundled corpus data/shakespeare.txt was not found (run from the repository root, or pass a text file)"
    )
}
