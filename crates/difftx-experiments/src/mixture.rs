//! The training mixture for small models: real text plus synthetic retrieval and in-context
//! documents, in explicit, configurable proportions, each task with its difficulty knobs.
//!
//! Formats (character level, kept ASCII so a byte tokenizer sees one token per character):
//! - key-value pair `kv` (a key of `key_len` letters directly followed by a value of
//!   `value_digits` digits, e.g. `q7`), the one retrieval primitive of both retrieval tasks; a
//!   question is the key again, answered by the value: the one-step copy that induction heads do
//!   (a separator between key and value would make it a two-step lookup, measured far slower to
//!   learn: docs/compare/calibration.md);
//! - needle document: pairs hidden in real text at random depths, then questions on new lines;
//! - recall document (multi-query associative recall, "MQAR"): `pairs` pairs, optionally with
//!   real-text filler words between them, then a line of queries `k:v` in random order;
//! - in-context classification: lines `input -> label`, demonstrations then the query line.
//!
//! The instruments (`needle`, `recall`, `attention`, `icl`) build their prompts with the same
//! functions, so a model trained on the mixture is evaluated on exactly the formats it saw.
//! Documents are at most `doc_chars` characters; `compare` trains on windows that start at a
//! document start, so every retrieval document sits whole in one training window.

use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Shape of the keys and values of the retrieval tasks (their difficulty knobs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairFormat {
    /// Letters per key.
    pub key_len: usize,
    /// Keys use the first `key_letters` lowercase letters (2..=26).
    pub key_letters: usize,
    /// Digits per value (chance of a right guess: 10^-value_digits).
    pub value_digits: usize,
}

impl Default for PairFormat {
    fn default() -> Self {
        PairFormat { key_len: 1, key_letters: 26, value_digits: 1 }
    }
}

impl PairFormat {
    pub fn validate(&self) -> Result<()> {
        if self.key_len == 0 || self.key_len > 4 || !(2..=26).contains(&self.key_letters) {
            bail!("keys must have 1..=4 letters from 2..=26 letters, got {} of {}", self.key_len, self.key_letters);
        }
        if self.value_digits == 0 || self.value_digits > 4 {
            bail!("values must have 1..=4 digits, got {}", self.value_digits);
        }
        Ok(())
    }
    /// Number of distinct keys.
    pub fn key_space(&self) -> usize {
        self.key_letters.pow(self.key_len as u32)
    }
    /// Probability of guessing a value right at random.
    pub fn chance(&self) -> f64 {
        10f64.powi(-(self.value_digits as i32))
    }
    pub fn key(&self, rng: &mut impl Rng) -> String {
        (0..self.key_len).map(|_| (b'a' + rng.random_range(0..self.key_letters as u8)) as char).collect()
    }
    pub fn value(&self, rng: &mut impl Rng) -> String {
        (0..self.value_digits).map(|_| (b'0' + rng.random_range(0..10u8)) as char).collect()
    }
    /// `n` pairs with distinct keys (n is capped at the key space).
    pub fn pairs(&self, n: usize, rng: &mut impl Rng) -> Vec<(String, String)> {
        let n = n.min(self.key_space());
        let mut out: Vec<(String, String)> = Vec::with_capacity(n);
        while out.len() < n {
            let k = self.key(rng);
            if out.iter().all(|(x, _)| *x != k) {
                out.push((k, self.value(rng)));
            }
        }
        out
    }
    /// Characters of one pair `kv`.
    pub fn pair_chars(&self) -> usize {
        self.key_len + self.value_digits
    }
}

/// Proportions and shapes of the training mixture. Fractions are of characters (training tokens
/// with the byte tokenizer) and are normalised by their sum (they need not add up to 1, but must not all be zero).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixtureSpec {
    pub text_fraction: f64,
    pub needle_fraction: f64,
    #[serde(default)]
    pub recall_fraction: f64,
    pub icl_fraction: f64,
    /// Documents are this many characters at most (at most the training sequence length).
    pub doc_chars: usize,
    /// Keys and values of the needle and recall tasks.
    #[serde(default)]
    pub pairs: PairFormat,
    /// Needles per needle document, inclusive range.
    pub needles: (usize, usize),
    /// Questions per needle document (each about a different needle), inclusive range.
    pub asked: (usize, usize),
    /// Key-value pairs per recall document, inclusive range (all of them are queried).
    #[serde(default = "default_recall_pairs")]
    pub recall_pairs: (usize, usize),
    /// Real-text words between consecutive pairs of a recall document, inclusive range.
    #[serde(default)]
    pub recall_filler: (usize, usize),
    /// Ask the questions of training recall and needle documents again, in reshuffled rounds,
    /// until the document fills `doc_chars` (a needle document's haystack then takes half of it):
    /// [`RecallDocument::text_with_rounds`], [`NeedleDocument::text_with_rounds`]. Specs written
    /// before the field load as false, the single round they were built with.
    #[serde(default)]
    pub question_rounds: bool,
    /// Demonstrations per in-context document, inclusive range.
    pub shots: (usize, usize),
    /// Number of classes of the synthetic classification task, inclusive range.
    pub classes: (usize, usize),
    /// Input letters per class in one in-context episode (0: the class's whole group of the
    /// alphabet, the default). Few letters make inputs recur within an episode, so that copying
    /// the label that followed the same input answers most queries; at the default budget it did
    /// not lift the baseline off chance (docs/compare/calibration.md).
    #[serde(default)]
    pub icl_letters: usize,
}

fn default_recall_pairs() -> (usize, usize) {
    (2, 8)
}

impl Default for MixtureSpec {
    fn default() -> Self {
        MixtureSpec {
            text_fraction: 0.2,
            needle_fraction: 0.25,
            recall_fraction: 0.35,
            icl_fraction: 0.2,
            doc_chars: 256,
            pairs: PairFormat::default(),
            needles: (1, 6),
            asked: (1, 3),
            recall_pairs: default_recall_pairs(),
            recall_filler: (0, 0),
            question_rounds: true,
            shots: (6, 18),
            classes: (4, 4),
            icl_letters: 0,
        }
    }
}

impl MixtureSpec {
    pub fn validate(&self) -> Result<()> {
        let f = [self.text_fraction, self.needle_fraction, self.recall_fraction, self.icl_fraction];
        if f.iter().any(|x| !x.is_finite() || *x < 0.0) || f.iter().sum::<f64>() <= 0.0 {
            bail!(
                "mixture fractions must be non-negative and not all zero, got text {} needle {} recall {} icl {}",
                f[0],
                f[1],
                f[2],
                f[3]
            );
        }
        if self.doc_chars < 64 {
            bail!("mixture documents of {} characters are too short (need at least 64)", self.doc_chars);
        }
        self.pairs.validate()?;
        for (name, (lo, hi)) in [
            ("needles", self.needles),
            ("asked", self.asked),
            ("recall_pairs", self.recall_pairs),
            ("shots", self.shots),
            ("classes", self.classes),
        ] {
            if lo == 0 || lo > hi {
                bail!("mixture range {name} = {lo}..={hi} is empty or starts at zero");
            }
        }
        if self.recall_filler.0 > self.recall_filler.1 {
            bail!("mixture range recall_filler = {:?} is empty", self.recall_filler);
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
        let c = if c.is_ascii() && !c.is_ascii_control() {
            c
        } else if c.is_whitespace() {
            ' '
        } else {
            continue;
        };
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

/// A needle as written in the text: the pair `kv`.
pub fn needle_sentence(key: &str, value: &str) -> String {
    format!("{key}{value}")
}

/// The question about `key` (on a new line): the key again; the value follows directly.
pub fn needle_question(key: &str) -> String {
    key.to_string()
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

/// One needle document of at most `max_chars` characters: real text with `n` needles at random
/// depths, then `r` questions, each on its own line followed by its answer.
/// `n` and `r` are reduced when that many needles and questions cannot fit `max_chars`.
pub fn needle_document(
    clean: &str,
    fmt: &PairFormat,
    n: usize,
    r: usize,
    max_chars: usize,
    rng: &mut impl Rng,
) -> String {
    needle_parts(clean, fmt, n, r, max_chars, rng).text()
}

/// A needle document as pieces: the haystack with its needles, and the asked `(key, value)`s.
#[derive(Debug, Clone, PartialEq)]
pub struct NeedleDocument {
    pub body: String,
    pub asked: Vec<(String, String)>,
}

impl NeedleDocument {
    /// The body, then each question on a new line with its answer.
    pub fn text(&self) -> String {
        self.as_queries().text()
    }

    /// [`text`](Self::text), then the questions asked again in reshuffled rounds as many times
    /// as fit in `max_chars` (training documents: see [`RecallDocument::text_with_rounds`]).
    pub fn text_with_rounds(&self, max_chars: usize, rng: &mut impl Rng) -> String {
        self.as_queries().rounds(max_chars, "\n", rng)
    }

    /// The same document in the shape of a recall document: the body, then `(prefix, value)`
    /// queries whose prefix is a new line and the question.
    fn as_queries(&self) -> RecallDocument {
        let queries = self.asked.iter().map(|(k, v)| (format!("\n{}", needle_question(k)), v.clone())).collect();
        RecallDocument { context: self.body.clone(), queries }
    }
}

/// [`needle_document`] in pieces.
pub fn needle_parts(
    clean: &str,
    fmt: &PairFormat,
    n: usize,
    r: usize,
    max_chars: usize,
    rng: &mut impl Rng,
) -> NeedleDocument {
    let pair = fmt.pair_chars() + 1;
    let r = r.clamp(1, (max_chars / (2 * pair)).max(1));
    let n = n.clamp(r, (max_chars.saturating_sub(pair * r) / pair).max(r));
    let needles = fmt.pairs(n, rng);
    let mut order: Vec<usize> = (0..needles.len()).collect();
    order.shuffle(rng);
    order.truncate(r.min(needles.len()));
    let asked: Vec<(String, String)> = order.iter().map(|&i| needles[i].clone()).collect();
    let qa_len: usize = asked.iter().map(|(k, v)| 1 + needle_question(k).len() + v.len()).sum();
    let fixed: usize = needles.iter().map(|(k, v)| needle_sentence(k, v).len() + 1).sum::<usize>() + qa_len;
    let hay_len = max_chars.saturating_sub(fixed);
    let hay_len = if hay_len > 0 { rng.random_range(hay_len / 3..=hay_len) } else { 0 };
    let hay = haystack(clean, hay_len, rng);
    let sentences: Vec<(String, f64)> =
        needles.iter().map(|(k, v)| (needle_sentence(k, v), rng.random_range(0.0..=1.0))).collect();
    let (body, _) = insert_at_depths(&hay, &sentences);
    NeedleDocument { body, asked }
}

/// Appends rounds to `s` while they fit in `max_chars`: each round is a newline, then `items` in
/// a fresh random order separated by `sep`.
fn push_rounds(s: &mut String, items: &[String], sep: &str, max_chars: usize, rng: &mut impl Rng) {
    if items.is_empty() {
        return;
    }
    let round_chars = 1 + items.iter().map(|x| x.len()).sum::<usize>() + sep.len() * (items.len() - 1);
    let mut order: Vec<usize> = (0..items.len()).collect();
    while s.len() + round_chars <= max_chars {
        order.shuffle(rng);
        s.push('\n');
        for (j, &i) in order.iter().enumerate() {
            if j > 0 {
                s.push_str(sep);
            }
            s.push_str(&items[i]);
        }
    }
}

/// Words of real text for the filler between recall pairs.
fn filler_words<'a>(words: &[&'a str], n: usize, rng: &mut impl Rng) -> Vec<&'a str> {
    if words.is_empty() || n == 0 {
        return Vec::new();
    }
    let start = rng.random_range(0..words.len());
    (0..n).map(|i| words[(start + i) % words.len()]).collect()
}

/// A recall document, as pieces: the context (pairs, each followed by `filler` real-text words)
/// and the queries `(prefix, value)` that follow it, where `prefix` ends with the key.
/// The document text is `context` then every `prefix + value` in order.
#[derive(Debug, Clone, PartialEq)]
pub struct RecallDocument {
    pub context: String,
    pub queries: Vec<(String, String)>,
}

impl RecallDocument {
    pub fn text(&self) -> String {
        let mut s = self.context.clone();
        for (p, v) in &self.queries {
            s.push_str(p);
            s.push_str(v);
        }
        s
    }

    /// The document with its round of queries repeated, reshuffled each time and on a new line,
    /// as many times as fit in `max_chars` (at least once). Used for training: every key of a
    /// window then keeps one value, so copying from context always pays, and a window holds one
    /// episode instead of several whose keys clash (docs/compare/calibration.md).
    pub fn text_with_rounds(&self, max_chars: usize, rng: &mut impl Rng) -> String {
        self.rounds(max_chars, " ", rng)
    }

    /// [`text`](Self::text), then rounds of the queries (prefixes without their leading
    /// whitespace, separated by `sep`) while they fit in `max_chars`.
    fn rounds(&self, max_chars: usize, sep: &str, rng: &mut impl Rng) -> String {
        let mut s = self.text();
        let items: Vec<String> = self.queries.iter().map(|(p, v)| format!("{}{v}", p.trim_start())).collect();
        push_rounds(&mut s, &items, sep, max_chars, rng);
        s
    }
}

/// Multi-query associative recall: `n` pairs (distinct keys), each followed by `filler` words of
/// `clean` text, then a new line and every pair's key queried once, in random order.
pub fn recall_document(
    clean_words: &[&str],
    fmt: &PairFormat,
    n: usize,
    filler: (usize, usize),
    rng: &mut impl Rng,
) -> RecallDocument {
    let pairs = fmt.pairs(n.max(1), rng);
    let mut context = String::new();
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            context.push(' ');
        }
        context.push_str(&needle_sentence(k, v));
        let nf = if filler.1 > 0 { rng.random_range(filler.0..=filler.1) } else { 0 };
        for w in filler_words(clean_words, nf, rng) {
            context.push(' ');
            context.push_str(w);
        }
    }
    context.push('\n');
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.shuffle(rng);
    let queries = order
        .iter()
        .enumerate()
        .map(|(j, &i)| {
            (format!("{}{}", if j > 0 { " " } else { "" }, needle_question(&pairs[i].0)), pairs[i].1.clone())
        })
        .collect();
    RecallDocument { context, queries }
}

/// Characters of a recall document with `n` pairs and no filler.
pub fn recall_chars(fmt: &PairFormat, n: usize) -> usize {
    2 * n * (fmt.pair_chars() + 1)
}

/// The synthetic in-context task: an input is one lowercase letter; its class is decided by
/// the letter (the alphabet cut into `classes` equal groups); each episode maps classes to
/// label words in its own random way, so the labels can only be read off the demonstrations.
/// An episode may also draw its inputs from only a few letters of each group (`letters`): the
/// same input then recurs within the episode, and a model can answer by copying the label that
/// followed it, or, better, by using the group.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticTask {
    pub labels: Vec<String>,
    /// The input letters of each class in this episode (each a subset of the class's group).
    pub letters: Vec<Vec<u8>>,
}

impl SyntheticTask {
    /// A random episode of `classes` classes whose inputs come from `letters_per_class` letters
    /// of each group (0, or more than a group holds: every letter of the group).
    pub fn random(classes: usize, letters_per_class: usize, rng: &mut impl Rng) -> Self {
        let k = classes.clamp(2, LABEL_WORDS.len());
        let mut words: Vec<&str> = LABEL_WORDS.to_vec();
        words.shuffle(rng);
        let letters = (0..k)
            .map(|class| {
                let mut group: Vec<u8> =
                    (Self::group_start(class, k)..Self::group_start(class + 1, k)).map(|i| b'a' + i as u8).collect();
                if letters_per_class > 0 && letters_per_class < group.len() {
                    group.shuffle(rng);
                    group.truncate(letters_per_class);
                }
                group
            })
            .collect();
        SyntheticTask { labels: words[..k].iter().map(|s| s.to_string()).collect(), letters }
    }
    /// First letter index (0 = 'a') of the group of `class` among `k` classes.
    fn group_start(class: usize, k: usize) -> usize {
        (class * 26).div_ceil(k)
    }
    /// Class index of an input.
    pub fn class_of(&self, input: &str) -> usize {
        let c = input.bytes().next().unwrap_or(b'a').clamp(b'a', b'z') - b'a';
        (c as usize * self.labels.len()) / 26
    }
    /// A random input of class `class`.
    pub fn input_of_class(&self, class: usize, rng: &mut impl Rng) -> String {
        // One letter: two random letters after it (the earlier format) only added noise between
        // the class and its label, and the baseline stayed at chance (docs/compare/calibration.md).
        // A u8 draw: for a whole group it is the draw of mixtures made before `letters` existed
        // (same random stream, so the committed mixtures are unchanged).
        let letters = &self.letters[class];
        (letters[rng.random_range(0..letters.len() as u8) as usize] as char).to_string()
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
pub fn icl_document(shots: usize, classes: usize, letters_per_class: usize, rng: &mut impl Rng) -> String {
    let task = SyntheticTask::random(classes, letters_per_class, rng);
    task.examples(shots + 1, rng)
        .iter()
        .map(|(x, c)| icl_line(x, &task.labels[*c]))
        .collect::<String>()
        .trim_end()
        .to_string()
}

/// Builds a mixture of about `windows × spec.doc_chars` characters (one epoch of that many
/// training windows) in the proportions of `spec`, shuffled, reproducibly from `seed`. The
/// fractions are of **characters** (hence of training tokens with the byte tokenizer), not of
/// documents: retrieval documents are much shorter than text documents, and counting documents
/// gave them about a tenth of the tokens at equal fractions. Each kind gets documents until its
/// share of characters is reached (at least one document when its fraction is positive). `text`
/// is real text (cleaned to ASCII here).
pub fn build_mixture(spec: &MixtureSpec, text: &str, windows: usize, seed: u64) -> Result<Vec<String>> {
    spec.validate()?;
    if windows == 0 {
        bail!("the mixture needs at least one window of text");
    }
    let clean = clean_text(text);
    let needs_text = spec.text_fraction > 0.0 || spec.needle_fraction > 0.0;
    if needs_text && clean.len() < spec.doc_chars {
        bail!("real text has {} usable characters, fewer than one document of {}", clean.len(), spec.doc_chars);
    }
    let words: Vec<&str> = clean.split(' ').collect();
    let budgets = mixture_chars(spec, windows * spec.doc_chars);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut docs = Vec::new();
    // Recall documents are capped to fit doc_chars with their filler.
    let per_pair_max = 2 * (spec.pairs.pair_chars() + 1) + spec.recall_filler.1 * 8;
    let max_pairs = (spec.doc_chars / per_pair_max).max(1);
    // In-context shots limited so the document fits doc_chars (a line is at most 3 + 4 + 5 + 1 chars).
    let max_shots = (spec.doc_chars / 13).saturating_sub(1).max(1);
    for (kind, &budget) in budgets.iter().enumerate() {
        let mut chars = 0;
        while chars < budget {
            let doc = match kind {
                0 => {
                    let len = rng.random_range(spec.doc_chars / 2..=spec.doc_chars);
                    haystack(&clean, len, &mut rng)
                }
                1 => {
                    let n = rng.random_range(spec.needles.0..=spec.needles.1);
                    let r = rng.random_range(spec.asked.0..=spec.asked.1).min(n);
                    if spec.question_rounds {
                        // Half the document for the haystack, the rest for rounds of questions.
                        needle_parts(&clean, &spec.pairs, n, r, spec.doc_chars / 2, &mut rng)
                            .text_with_rounds(spec.doc_chars, &mut rng)
                    } else {
                        needle_document(&clean, &spec.pairs, n, r, spec.doc_chars, &mut rng)
                    }
                }
                2 => {
                    let n = rng.random_range(spec.recall_pairs.0..=spec.recall_pairs.1).min(max_pairs);
                    let doc = recall_document(&words, &spec.pairs, n, spec.recall_filler, &mut rng);
                    let text =
                        if spec.question_rounds { doc.text_with_rounds(spec.doc_chars, &mut rng) } else { doc.text() };
                    truncate_chars(text, spec.doc_chars)
                }
                _ => {
                    let k = rng.random_range(spec.classes.0..=spec.classes.1);
                    let s = rng.random_range(spec.shots.0..=spec.shots.1).min(max_shots);
                    icl_document(s, k, spec.icl_letters, &mut rng)
                }
            };
            // +1: the newline that separates documents in the token stream.
            chars += doc.len() + 1;
            docs.push(doc);
        }
    }
    docs.shuffle(&mut rng);
    Ok(docs)
}

/// At most `max` characters of an ASCII document (long filler words can overflow the estimate).
fn truncate_chars(mut s: String, max: usize) -> String {
    if s.len() > max {
        s.truncate(max);
    }
    s
}

/// Characters of each kind (text, needle, recall, icl) in a mixture of `total` characters: the
/// fractions normalised by their sum.
pub fn mixture_chars(spec: &MixtureSpec, total: usize) -> [usize; 4] {
    let f = [spec.text_fraction, spec.needle_fraction, spec.recall_fraction, spec.icl_fraction];
    let sum: f64 = f.iter().sum();
    f.map(|x| (x / sum * total as f64).round() as usize)
}

/// Reads `path` or, when None, the bundled corpus, with a clear error.
pub fn read_corpus(path: Option<&std::path::Path>) -> Result<String> {
    let p = match path {
        Some(p) => p.to_path_buf(),
        None => difftx_train::data::bundled_corpus()?,
    };
    std::fs::read_to_string(&p).map_err(|e| anyhow::anyhow!("cannot read text {}: {e}", p.display()))
}
