//! Tokenizers: text <-> token ids.
//!
//! This module owns everything about turning text into ids and back:
//! - [`Tokenizer`]: either the built-in byte-level tokenizer (vocab 256, id = byte value)
//!   or a Hugging Face `tokenizer.json` loaded through the `tokenizers` crate;
//! - how a model folder records its tokenizer ([`Tokenizer::from_model_dir`],
//!   [`Tokenizer::save_to_model_dir`]);
//! - [`StreamDecoder`], incremental decoding for streaming generation;
//! - [`train_bpe`], training a byte-level BPE tokenizer on text files.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, TokenizerImpl};

/// File name of a Hugging Face tokenizer inside a model folder.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// File name of the marker that says a model folder uses the byte tokenizer.
pub const BYTES_MARKER: &str = "tokenizer_bytes.json";

/// Vocabulary size of the byte tokenizer.
pub const BYTE_VOCAB: usize = 256;

/// A text tokenizer.
pub enum Tokenizer {
    /// Byte-level: each UTF-8 byte is one token, id = byte value, vocab 256.
    Bytes,
    /// A Hugging Face tokenizer (from a `tokenizer.json`).
    Hf(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({}, vocab {})", self.kind(), self.vocab_size())
    }
}

impl Tokenizer {
    /// The byte-level tokenizer: vocab 256, id = byte value.
    pub fn bytes() -> Self {
        Tokenizer::Bytes
    }

    /// Load a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        if !path.is_file() {
            bail!("tokenizer file {} does not exist or is not a file", path.display());
        }
        let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            anyhow::anyhow!("could not load tokenizer {}: {e} (expected a Hugging Face tokenizer.json)", path.display())
        })?;
        Ok(Tokenizer::Hf(Box::new(tok)))
    }

    /// Load the tokenizer of a model folder: `tokenizer.json` if present; otherwise the
    /// byte tokenizer (the folder may hold a `tokenizer_bytes.json` marker `{"type":"bytes"}`,
    /// or no tokenizer file at all).
    pub fn from_model_dir(dir: &Path) -> anyhow::Result<Self> {
        if !dir.is_dir() {
            bail!("model folder {} does not exist or is not a folder", dir.display());
        }
        let json = dir.join(TOKENIZER_JSON);
        if json.exists() {
            return Self::from_file(&json);
        }
        let marker = dir.join(BYTES_MARKER);
        if marker.exists() {
            let raw = fs::read_to_string(&marker).with_context(|| format!("could not read {}", marker.display()))?;
            let v: serde_json::Value = serde_json::from_str(&raw)
                .with_context(|| format!("{} is not valid JSON (expected {{\"type\":\"bytes\"}})", marker.display()))?;
            match v.get("type").and_then(|t| t.as_str()) {
                Some("bytes") => {}
                other => bail!("{} has type {:?}; expected {{\"type\":\"bytes\"}}", marker.display(), other),
            }
        }
        Ok(Tokenizer::Bytes)
    }

    /// Record this tokenizer in a model folder (created if missing): `tokenizer.json` for HF,
    /// the `tokenizer_bytes.json` marker for bytes. A file for the other kind left in the
    /// folder is removed, so that [`Tokenizer::from_model_dir`] loads this tokenizer.
    pub fn save_to_model_dir(&self, dir: &Path) -> anyhow::Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("could not create model folder {}", dir.display()))?;
        let json = dir.join(TOKENIZER_JSON);
        let marker = dir.join(BYTES_MARKER);
        match self {
            Tokenizer::Bytes => {
                fs::write(&marker, "{\"type\":\"bytes\"}\n")
                    .with_context(|| format!("could not write {}", marker.display()))?;
                remove_if_exists(&json)?;
            }
            Tokenizer::Hf(tok) => {
                tok.save(&json, true)
                    .map_err(|e| anyhow::anyhow!("could not write tokenizer {}: {e}", json.display()))?;
                remove_if_exists(&marker)?;
            }
        }
        Ok(())
    }

    /// Number of token ids (for HF, including added tokens).
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => BYTE_VOCAB,
            Tokenizer::Hf(tok) => tok.get_vocab_size(true),
        }
    }

    /// One past the largest id the tokenizer can decode (for HF the largest in its vocabulary
    /// with added tokens, which may leave gaps below it): what a `Sampler` is limited to.
    pub fn id_limit(&self) -> usize {
        match self {
            Tokenizer::Bytes => BYTE_VOCAB,
            Tokenizer::Hf(tok) => tok.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1),
        }
    }

    /// Encode text to ids, without adding special tokens.
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Hf(tok) => {
                let enc =
                    tok.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizer failed to encode text: {e}"))?;
                Ok(enc.get_ids().to_vec())
            }
        }
    }

    /// Decode ids to text. Bytes: invalid UTF-8 becomes U+FFFD; an id above 255 is an error.
    /// HF: special tokens are skipped.
    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        match self {
            Tokenizer::Bytes => Ok(String::from_utf8_lossy(&ids_to_bytes(ids)?).into_owned()),
            Tokenizer::Hf(tok) => {
                tok.decode(ids, true).map_err(|e| anyhow::anyhow!("tokenizer failed to decode ids: {e}"))
            }
        }
    }

    /// `"bytes"` or `"hf"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Tokenizer::Bytes => "bytes",
            Tokenizer::Hf(_) => "hf",
        }
    }
}

fn remove_if_exists(path: &Path) -> anyhow::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("could not remove stale {}", path.display())),
    }
}

fn ids_to_bytes(ids: &[u32]) -> anyhow::Result<Vec<u8>> {
    ids.iter()
        .map(|&id| {
            u8::try_from(id)
                .map_err(|_| anyhow::anyhow!("token id {id} is out of range for the byte tokenizer (vocab 256)"))
        })
        .collect()
}

/// Incremental decoding for streaming generation: push ids one at a time and get back only
/// the newly completed text. A multi-byte character split across tokens is held back until
/// it is complete, so the pieces concatenate to valid UTF-8.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    /// Bytes: bytes not yet emitted (an incomplete UTF-8 sequence).
    pending: Vec<u8>,
    /// HF: all ids pushed so far.
    ids: Vec<u32>,
    /// HF: start of the suffix that is decoded each step (one token of left context).
    prefix_start: usize,
    /// HF: ids before this index have been emitted.
    emitted_upto: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        StreamDecoder { tok, pending: Vec::new(), ids: Vec::new(), prefix_start: 0, emitted_upto: 0 }
    }

    /// Add one id; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> anyhow::Result<String> {
        match self.tok {
            Tokenizer::Bytes => {
                self.pending.extend(ids_to_bytes(&[id])?);
                Ok(self.drain_bytes(false))
            }
            Tokenizer::Hf(_) => {
                // Decode the suffix with and without the new id (the suffix starts one token
                // earlier than what was emitted, so decoders that strip a leading space still
                // see context); emit what the new id adds once it ends in a whole character.
                let prev = self.tok.decode(&self.ids[self.prefix_start..self.emitted_upto])?;
                self.ids.push(id);
                let text = self.tok.decode(&self.ids[self.prefix_start..])?;
                if text.len() > prev.len() && !text.ends_with('\u{FFFD}') {
                    if let Some(new) = text.get(prev.len()..) {
                        if text.starts_with(&prev) {
                            let new = new.to_string();
                            self.prefix_start = self.emitted_upto;
                            self.emitted_upto = self.ids.len();
                            return Ok(new);
                        }
                    }
                }
                Ok(String::new())
            }
        }
    }

    /// Flush what is still held back (an incomplete character is emitted as U+FFFD).
    pub fn finish(&mut self) -> anyhow::Result<String> {
        match self.tok {
            Tokenizer::Bytes => Ok(self.drain_bytes(true)),
            Tokenizer::Hf(_) => {
                if self.emitted_upto == self.ids.len() {
                    return Ok(String::new());
                }
                let prev = self.tok.decode(&self.ids[self.prefix_start..self.emitted_upto])?;
                let text = self.tok.decode(&self.ids[self.prefix_start..])?;
                self.prefix_start = self.emitted_upto;
                self.emitted_upto = self.ids.len();
                Ok(match text.strip_prefix(&prev) {
                    Some(new) => new.to_string(),
                    None => text.get(prev.len()..).unwrap_or("").to_string(),
                })
            }
        }
    }

    /// Byte mode: take the longest valid UTF-8 prefix of `pending`; invalid bytes become
    /// U+FFFD; an incomplete trailing sequence stays pending unless `flush`.
    fn drain_bytes(&mut self, flush: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(good).expect("valid prefix"));
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                        None if flush => {
                            out.push('\u{FFFD}');
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }
}

/// Train a byte-level BPE tokenizer (GPT-2 style: ByteLevel pre-tokenizer and decoder, the
/// full 256-byte initial alphabet so any text encodes) on text files and write it as a
/// `tokenizer.json` to `out`. `vocab_size` counts the 256 byte tokens; training stops early
/// if the text offers no more merges.
pub fn train_bpe(files: &[PathBuf], vocab_size: usize, out: &Path) -> anyhow::Result<()> {
    if vocab_size < BYTE_VOCAB {
        bail!("BPE vocab size {vocab_size} is too small: it must be at least 256 (the byte alphabet)");
    }
    if files.is_empty() {
        bail!("no training files given for the BPE tokenizer");
    }
    for f in files {
        if !f.is_file() {
            bail!("BPE training file {} does not exist or is not a file", f.display());
        }
    }
    let byte_level = ByteLevel::new(false, true, true);
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(0)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect::<HashSet<char>>())
        .build();
    let mut tok: TokenizerImpl<BPE, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper> =
        TokenizerImpl::new(BPE::default());
    tok.with_pre_tokenizer(Some(byte_level));
    tok.with_decoder(Some(byte_level));
    let names: Vec<String> = files.iter().map(|f| f.to_string_lossy().into_owned()).collect();
    tok.train_from_files(&mut trainer, names)
        .map_err(|e| anyhow::anyhow!("BPE training failed (are all the files UTF-8 text?): {e}"))?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).with_context(|| format!("could not create folder {}", parent.display()))?;
    }
    tok.save(out, true).map_err(|e| anyhow::anyhow!("could not write tokenizer {}: {e}", out.display()))?;
    Ok(())
}
