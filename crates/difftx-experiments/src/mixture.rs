//! The default training mixture for small models: real text plus synthetic retrieval documents
//! and synthetic in-context classification documents, in explicit, configurable proportions.
//!
//! Formats (character level; a byte tokenizer is assumed, so text is kept ASCII):
//! - needle: `The magic number of X is Y.` inside real text; then `What is the magic number of X? Y`
//! - in-context classification: lines `input -> label`, k demonstrations then the query line.
//!
//! The instruments (`needle`, `attention`, `icl`) build their prompts with the same functions, so
//! a model trained on the mixture is evaluated on exactly the formats it saw.

use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Proportions and shapes of the training mixture. Fractions are of documents and are
/// normalised by their sum (they need not add up to 1, but must not all be zero).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixtureSpec {
    pub text_fraction: f64,
    pub needle_fraction: f64,
    pub icl_fraction: f64,
    /// Documents are this many characters at most (set it to the training sequence length so a
    /// retrieval question sits in the same window as its needles).
    pub doc_chars: usize,
    /// Needles per retrieval document, inclusive range.
    pub needles: (usize, usize),
    /// Questions per retrieval document (each about a different needle), inclusive range.
    pub asked: (usize, usize),
    /// Demonstrations per in-context document, inclusive range.
    pub shots: (usize, usize),
    /// Number of classes of the synthetic classification task, inclusive range.
    pub classes: (usize, usize),
}

impl Default for MixtureSpec {
    fn default() -> Self {
        MixtureSpec {
            text_fraction: 0.4,
            needle_fraction: 0.4,
            icl_fraction: 0.2,
            doc_chars: 256,
            needles: (1, 6),
            asked: (1, 2),
            shots: (2, 8),
            classes: (2, 3),
        }
    }
}

impl MixtureSpec {
    pub fn validate(&self) -> Result<()> {
        let f = [self.text_fraction, self.needle_fraction, self.icl_fraction];
        if f.iter().any(|x| !x.is_finite() || *x < 0.0) || f.iter().sum::<f64>() <= 0.0 {
            bail!("mixture fractions must be non-negative and not all zero, got text {} needle {} icl {}", f[0], f[1], f[2]);
        }
        if self.doc_chars < 64 {
            bail!("mixture documents of {} characters are too short (need at least 64)", self.doc_chars);
        }
        for (name, (lo, hi)) in [("needles", self.needles), ("asked", self.asked), ("shots", self.shots), ("classes", self.classes)] {
            if lo == 0 || lo > hi {
                bail!("mixture range {name} = {lo}..={hi} is empty or starts at zero");
            }
        }
        if self.classes.1 > LABEL_WORDS.len() {
            bail!("at most {} classes are supported", LABEL_WORDS.len());
        }
        Ok(())
    }
}

/// Label words of the synthetic classification task (a document draws its own subset and order).
pub const LABEL_WORDS: [&str; 6] = ["red", "blue", "green", "gold", "gray", "pink"];

/// Real text cleaned for the byte-level formats: ASCII only, whitespace runs collapsed to one space.
pub fn clean_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut last_space = true;
    for c in text.chars() {
        let c = if c.is_ascii() && !c.is_ascii_control() { c } else if c.is_whitespace() { ' ' } else { continue };
        if c == ' ' {
            if !last_space {
                out.push(' ');
            }
            last_space = true;
        } else {
            out.push(c);
            last_space = false;
        }
    }
    out.trim().to_string()
}

/// A random slice of `clean` of about `len` characters, starting and ending on word boundaries.
pub fn haystack(clean: &str, len: usize, rng: &mut impl Rng) -> String {
    if len == 0 || clean.is_empty() {
        return String::new();
    }
    let b = clean.as_bytes();
    if b.len() <= len {
        return clean.to_string();
    }
    let mut start = rng.random_range(0..b.len() - len);
    while start < b.len() && start > 0 && b[start - 1] != b' ' {
        start += 1;
    }
    let end = (start + len).min(b.len());
    let s = &clean[start..end];
    // Drop a cut word at the end.
    match s.rfind(' ') {
        Some(p) if end < b.len() && p > len / 2 => s[..p].to_string(),
        _ => s.to_string(),
    }
}

/// A needle key: three random lowercase letters.
pub fn needle_key(rng: &mut impl Rng) -> String {
    (0..3).map(|_| (b'a' + rng.random_range(0..26u8)) as char).collect()
}

/// A needle value: a two-digit number.
pub fn needle_value(rng: &mut impl Rng) -> String {
    rng.random_range(10..100u32).to_string()
}

pub fn needle_sentence(key: &str, value: &str) -> String {
    format!("The magic number of {key} is {value}.")
}

/// The question, ending just before the answer (the answer follows after the space).
pub fn needle_question(key: &str) -> String {
    format!("What is the magic number of {key}? ")
}

/// `n` needles with distinct keys.
pub fn draw_needles(n: usize, rng: &mut impl Rng) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::with_capacity(n);
    while out.len() < n {
        let k = needle_key(rng);
        if out.iter().all(|(x, _)| *x != k) {
            out.push((k, needle_value(rng)));
        }
    }
    out
}

/// Inserts `sentences` into `hay` at the given fractional depths (0 = start, 1 = end), each at
/// the word boundary nearest its depth. Returns the text and, for each sentence, its byte range.
pub fn insert_at_depths(hay: &str, sentences: &[(String, f64)]) -> (String, Vec<std::ops::Range<usize>>) {
    let b = hay.as_bytes();
    let mut cuts: Vec<(usize, usize)> = sentences
        .iter()
        .enumerate()
        .map(|(i, (_, d))| {
            let target = (d.clamp(0.0, 1.0) * b.len() as f64).round() as usize;
            // nearest position that is 0, len, or just after a space
            let mut best = if target * 2 <= b.len() { 0 } else { b.len() };
            for p in 0..=b.len() {
                if (p == 0 || p == b.len() || b[p - 1] == b' ') && p.abs_diff(target) < best.abs_diff(target) {
                    best = p;
                }
            }
            (best, i)
        })
        .collect();
    // ties (same cut, e.g. an empty haystack) keep the order of depths
    cuts.sort_by(|x, y| x.0.cmp(&y.0).then(sentences[x.1].1.total_cmp(&sentences[y.1].1)).then(x.1.cmp(&y.1)));
    let mut out = String::with_capacity(hay.len() + sentences.iter().map(|s| s.0.len() + 2).sum::<usize>());
    let mut ranges = vec![0..0; sentences.len()];
    let mut prev = 0;
    for (pos, i) in cuts {
        out.push_str(&hay[prev..pos]);
        if !out.is_empty() && !out.ends_with(' ') {
            out.push(' ');
        }
        let s = &sentences[i].0;
        ranges[i] = out.len()..out.len() + s.len();
        out.push_str(s);
        out.push(' ');
        prev = pos;
    }
    out.push_str(&hay[prev..]);
    (out.trim_end().to_string(), ranges)
}

/// One retrieval document of at most `max_chars` characters: real text with `n` needles at random
/// depths, then `r` questions each followed by its answer on its own line.
/// `n` and `r` are reduced when that many needles and questions cannot fit `max_chars`.
pub fn needle_document(clean: &str, n: usize, r: usize, max_chars: usize, rng: &mut impl Rng) -> String {
    // A needle sentence takes 31 characters with its separator, a question line 36.
    let r = r.clamp(1, (max_chars / 67).max(1));
    let n = n.clamp(r, ((max_chars.saturating_sub(36 * r)) / 31).max(r));
    let needles = draw_needles(n, rng);
    let mut asked: Vec<usize> = (0..n).collect();
    asked.shuffle(rng);
    asked.truncate(r.min(n));
    let qa: String = asked.iter().map(|&i| format!("\n{}{}", needle_question(&needles[i].0), needles[i].1)).collect();
    let fixed: usize = needles.iter().map(|(k, v)| needle_sentence(k, v).len() + 1).sum::<usize>() + qa.len();
    let hay_len = max_chars.saturating_sub(fixed);
    let hay_len = if hay_len > 0 { rng.random_range(hay_len / 3..=hay_len) } else { 0 };
    let hay = haystack(clean, hay_len, rng);
    let sentences: Vec<(String, f64)> =
        needles.iter().map(|(k, v)| (needle_sentence(k, v), rng.random_range(0.0..=1.0))).collect();
    let (text, _) = insert_at_depths(&hay, &sentences);
    format!("{text}{qa}")
}

/// The synthetic in-context task: an input is three lowercase letters; its class is decided by
/// its first letter (the alphabet cut into `classes` equal groups); each episode maps classes to
/// label words in its own random way, so the labels can only be read off the demonstrations.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticTask {
    pub labels: Vec<String>,
}

impl SyntheticTask {
    pub fn random(classes: usize, rng: &mut impl Rng) -> Self {
        let mut words: Vec<&str> = LABEL_WORDS.to_vec();
        words.shuffle(rng);
        SyntheticTask { labels: words[..classes.clamp(2, LABEL_WORDS.len())].iter().map(|s| s.to_string()).collect() }
    }
    /// Class index of an input.
    pub fn class_of(&self, input: &str) -> usize {
        let c = input.bytes().next().unwrap_or(b'a').clamp(b'a', b'z') - b'a';
        (c as usize * self.labels.len()) / 26
    }
    /// A random input of class `class`.
    pub fn input_of_class(&self, class: usize, rng: &mut impl Rng) -> String {
        let k = self.labels.len();
        let lo = (class * 26).div_ceil(k);
        let hi = ((class + 1) * 26).div_ceil(k);
        let first = (b'a' + rng.random_range(lo as u8..hi as u8)) as char;
        let rest: String = (0..2).map(|_| (b'a' + rng.random_range(0..26u8)) as char).collect();
        format!("{first}{rest}")
    }
    /// `n` examples `(input, label index)`, classes drawn uniformly.
    pub fn examples(&self, n: usize, rng: &mut impl Rng) -> Vec<(String, usize)> {
        (0..n)
            .map(|_| {
                let c = rng.random_range(0..self.labels.len());
                (self.input_of_class(c, rng), c)
            })
            .collect()
    }
}

/// One demonstration line, `input -> label`.
pub fn icl_line(input: &str, label: &str) -> String {
    format!("{input} -> {label}\n")
}

/// The query prompt: `input ->` (the label is scored as " label").
pub fn icl_query(input: &str) -> String {
    format!("{input} ->")
}

/// One in-context document: `shots` demonstrations then a query with its answer.
pub fn icl_document(shots: usize, classes: usize, rng: &mut impl Rng) -> String {
    let task = SyntheticTask::random(classes, rng);
    task.examples(shots + 1, rng).iter().map(|(x, c)| icl_line(x, &task.labels[*c])).collect::<String>().trim_end().to_string()
}

/// Builds `n_docs` documents in the proportions of `spec`, shuffled, reproducibly from `seed`.
/// `text` is real text (cleaned to ASCII here). Document counts per kind are the rounded
/// fractions of `n_docs` (largest remainder), so the composition is exact, not sampled.
pub fn build_mixture(spec: &MixtureSpec, text: &str, n_docs: usize, seed: u64) -> Result<Vec<String>> {
    spec.validate()?;
    if n_docs == 0 {
        bail!("the mixture needs at least one document");
    }
    let clean = clean_text(text);
    if (spec.text_fraction > 0.0 || spec.needle_fraction > 0.0) && clean.len() < spec.doc_chars {
        bail!("real text has {} usable characters, fewer than one document of {}", clean.len(), spec.doc_chars);
    }
    let counts = mixture_counts(spec, n_docs);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut docs = Vec::with_capacity(n_docs);
    for _ in 0..counts[0] {
        let len = rng.random_range(spec.doc_chars / 2..=spec.doc_chars);
        docs.push(haystack(&clean, len, &mut rng));
    }
    for _ in 0..counts[1] {
        let n = rng.random_range(spec.needles.0..=spec.needles.1);
        let r = rng.random_range(spec.asked.0..=spec.asked.1).min(n);
        docs.push(needle_document(&clean, n, r, spec.doc_chars, &mut rng));
    }
    for _ in 0..counts[2] {
        let k = rng.random_range(spec.classes.0..=spec.classes.1);
        // shots limited so the document fits doc_chars (a line is at most 3 + 4 + 5 + 1 chars)
        let max_shots = (spec.doc_chars / 13).saturating_sub(1).max(1);
        let s = rng.random_range(spec.shots.0..=spec.shots.1).min(max_shots);
        docs.push(icl_document(s, k, &mut rng));
    }
    docs.shuffle(&mut rng);
    Ok(docs)
}

/// Number of documents of each kind (text, needle, icl) for `n_docs` documents.
pub fn mixture_counts(spec: &MixtureSpec, n_docs: usize) -> [usize; 3] {
    let f = [spec.text_fraction, spec.needle_fraction, spec.icl_fraction];
    let sum: f64 = f.iter().sum();
    let exact: Vec<f64> = f.iter().map(|x| x / sum * n_docs as f64).collect();
    let mut counts = [0usize; 3];
    for i in 0..3 {
        counts[i] = exact[i].floor() as usize;
    }
    let mut rem: Vec<(f64, usize)> = (0..3).map(|i| (exact[i] - counts[i] as f64, i)).collect();
    rem.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1)));
    let mut left = n_docs - counts.iter().sum::<usize>();
    for (_, i) in rem {
        if left == 0 {
            break;
        }
        counts[i] += 1;
        left -= 1;
    }
    counts
}

/// The bundled corpus path (`data/shakespeare.txt` at the repository root).
pub fn bundled_corpus() -> Result<std::path::PathBuf> {
    difftx_train::data::bundled_corpus()
}

/// Reads `path` or, when None, the bundled corpus, with a clear error.
pub fn read_corpus(path: Option<&std::path::Path>) -> Result<String> {
    let p = match path {
        Some(p) => p.to_path_buf(),
        None => bundled_corpus()?,
    };
    std::fs::read_to_string(&p).map_err(|e| anyhow::anyhow!("cannot read text {}: {e}", p.display()))
}
