//! Autoregressive generation with a KV cache: greedy, temperature, top-k and top-p sampling, and
//! speculative decoding (greedy or sampled).

use crate::model::decode::{Decoder, SequenceCache};
use crate::model::{last_logits, KvCache, Model};
use anyhow::{bail, Result};
use candle_core::Tensor;
use difftx_kernels::decode::{KvPrecision, WeightPrecision};
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.8, top_k: None, top_p: None, seed: 0 }
    }
}

/// Picks tokens from logits: greedy (temperature 0) or sampled.
///
/// Sampling is the Gumbel-max draw: the token with the largest `logit / temperature + g`, where
/// `g = −ln(−ln u)` is Gumbel noise, one `u` per token of the vocabulary, drawn afresh for every
/// token given out from a generator keyed by the seed and that token's index in the output. Among
/// the candidates top-k and top-p keep, this picks each with exactly its softmax probability (the
/// Gumbel-max property), like a draw from the softmax. What a draw gives depends on nothing but the
/// seed, the index and the logits, so whatever computes the logits of a token (a single step, a
/// batched step, a speculative pass over several positions) picks the same token from the same
/// logits: speculative decoding gives sampled text identical to plain sampling's, as it does
/// greedy text (docs/design.md §7.32).
pub struct Sampler {
    params: SamplingParams,
    /// Tokens given out so far: the index of the next one.
    given: u64,
    /// Draws only among token ids below this (`limited_to`).
    ids: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        // Rejects NaN as well as negative values.
        if params.temperature.is_nan() || params.temperature < 0.0 {
            bail!("temperature must be >= 0, got {}", params.temperature);
        }
        if let Some(p) = params.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("top-p must be in (0, 1], got {p}");
            }
        }
        if params.top_k == Some(0) {
            bail!("top-k must be at least 1");
        }
        // Top-p 1 keeps every token: the plain draw, without top-p's softmax and cut over the
        // whole vocabulary (as transformers leaves out its top-p warper at 1); the server passes
        // an API request's `top_p` (1 by default) through to here.
        let params = SamplingParams { top_p: params.top_p.filter(|&p| p < 1.0), ..params };
        Ok(Sampler { params, given: 0, ids: usize::MAX })
    }

    /// Draws only among the token ids below `ids`: those the tokenizer can decode, where the
    /// model's vocabulary is larger than its tokenizer's (padded, or set larger by a config, whose
    /// extra ids a short run leaves likely enough to be drawn).
    pub fn limited_to(mut self, ids: usize) -> Self {
        self.ids = ids;
        self
    }

    /// Picks the next token from one position's logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = self.pick(logits, 0);
        self.given += 1;
        token
    }

    /// The token `sample` would give `ahead` calls from now if handed these logits then (no state
    /// changes): how a speculative pass draws its drafts and checks them.
    pub fn pick(&self, logits: &[f32], ahead: usize) -> u32 {
        let logits = &logits[..self.ids.min(logits.len())];
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let (candidates, probs) = self.candidates(logits);
        if candidates.is_empty() {
            return argmax(logits);
        }
        // A few candidates (top-k, a sharp top-p) seek to their own uniforms; many read the
        // stream in order.
        let seek = candidates.len() * 16 < logits.len();
        let uniforms = uniforms(self.params.seed, self.given + ahead as u64, &candidates, seek);
        let Some(probs) = probs else {
            return candidates[gumbel_max(logits, self.params.temperature, &candidates, &uniforms).0] as u32;
        };
        // Top-p has the probabilities at hand: `p / (−ln u)`, the exponential of `logit / T + g`
        // up to a constant (the same order), for one logarithm a token instead of two.
        let scores = candidates.iter().zip(probs.iter().zip(uniforms)).map(|(&t, (p, u))| (t, p / -u.ln()));
        scores.max_by(|a, b| a.1.total_cmp(&b.1)).expect("at least one candidate").0 as u32
    }

    /// Records `n` tokens given out without `sample` (those a speculative pass gave).
    pub fn advance(&mut self, n: usize) {
        self.given += n as u64;
    }

    /// The tokens top-k and top-p keep among those with a finite logit (all of them without
    /// either), in no particular order, and under top-p their probabilities before the cut.
    /// Equal logits are ranked by token id, so the kept set is a function of the logits alone.
    fn candidates(&self, logits: &[f32]) -> (Vec<usize>, Option<Vec<f64>>) {
        let mut idx: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
        let by_logit = |a: &usize, b: &usize| rank_order((logits[*a], *a), (logits[*b], *b));
        if let Some(k) = self.params.top_k {
            if k < idx.len() {
                idx.select_nth_unstable_by(k - 1, by_logit);
                idx.truncate(k);
            }
        }
        let Some(top_p) = self.params.top_p else {
            return (idx, None);
        };
        let probs = self.softmax(logits, &idx);
        let mut ranked: Vec<Ranked> =
            idx.into_iter().zip(probs).map(|(token, p)| Ranked { logit: logits[token], token, p }).collect();
        let keep = nucleus(&mut ranked, top_p);
        ranked.truncate(keep);
        let (tokens, probs): (Vec<usize>, Vec<f64>) = ranked.into_iter().map(|r| (r.token, r.p)).unzip();
        (tokens, Some(probs))
    }

    /// Softmax at the temperature over the tokens `idx`.
    fn softmax(&self, logits: &[f32], idx: &[usize]) -> Vec<f64> {
        let max = idx.iter().map(|&i| logits[i] as f64).fold(f64::NEG_INFINITY, f64::max);
        let probs: Vec<f64> = idx.iter().map(|&i| ((logits[i] as f64 - max) / self.params.temperature).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.into_iter().map(|p| p / total).collect()
    }

    /// The distribution `sample` draws from: the tokens it may pick with their probabilities
    /// (summing to 1). Greedy, or logits none of which is finite: the argmax alone.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let logits = &logits[..self.ids.min(logits.len())];
        if self.params.temperature == 0.0 {
            return vec![(argmax(logits), 1.0)];
        }
        let (candidates, probs) = self.candidates(logits);
        if candidates.is_empty() {
            return vec![(argmax(logits), 1.0)];
        }
        // Top-p's probabilities cover the tokens before its cut: renormalised over those kept.
        let probs = match probs {
            Some(probs) => {
                let total: f64 = probs.iter().sum();
                probs.into_iter().map(|p| p / total).collect()
            }
            None => self.softmax(logits, &candidates),
        };
        candidates.into_iter().map(|i| i as u32).zip(probs).collect()
    }
}

/// Logit values (rows × vocabulary) from which [`sample_rows`] spreads its rows' draws over the
/// decode team (two rows of a 32,000-token vocabulary; a single row runs on the calling thread
/// either way): such a draw takes ~0.4 ms (docs/design.md §7.33), and sixteen requests' draws in
/// turn took longer than their batched step; below this a split costs more than it saves.
const SPLIT_DRAWS_FROM: usize = 1 << 15;

/// Each request's next token from its own row of `logits` (`[rows, vocab]`, a batched step's),
/// what `samplers[i].sample(row i)` in turn gives: a draw depends on its sampler and its row
/// only, so a big batch's draws run side by side on the decode team's threads (awake right after
/// the step that made the logits).
pub fn sample_rows(samplers: &mut [&mut Sampler], logits: &[f32]) -> Vec<u32> {
    if samplers.is_empty() {
        return Vec::new();
    }
    let vocab = logits.len() / samplers.len();
    assert_eq!(logits.len(), samplers.len() * vocab, "sample_rows: one row of logits per sampler");
    let mut draws: Vec<(&mut Sampler, &[f32], u32)> =
        samplers.iter_mut().zip(logits.chunks_exact(vocab)).map(|(s, row)| (&mut **s, row, 0)).collect();
    if logits.len() >= SPLIT_DRAWS_FROM {
        difftx_kernels::team::for_each_mut(&mut draws, |_, (sampler, row, token)| *token = sampler.sample(row));
    } else {
        draws.iter_mut().for_each(|(sampler, row, token)| *token = sampler.sample(row));
    }
    draws.into_iter().map(|(_, _, token)| token).collect()
}

/// The uniforms in [0, 1) of `tokens` for the token given out at `index`: token t's is the t-th
/// f64 of a ChaCha stream keyed by the seed and the index (both whole: no two pairs share a
/// stream), so a token's noise does not depend on which others are candidates. `seek`: each
/// token's value found by seeking in the stream, else the stream read in order up to the last
/// token; the same values either way.
fn uniforms(seed: u64, index: u64, tokens: &[usize], seek: bool) -> Vec<f64> {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&index.to_le_bytes());
    let mut rng = rand_chacha::ChaCha12Rng::from_seed(key);
    if seek {
        tokens
            .iter()
            .map(|&t| {
                // An f64 takes two 32-bit words of the stream.
                rng.set_word_pos(2 * t as u128);
                rng.random::<f64>()
            })
            .collect()
    } else {
        let last = tokens.iter().max().map_or(0, |&t| t + 1);
        let in_order: Vec<f64> = (0..last).map(|_| rng.random::<f64>()).collect();
        if tokens.iter().enumerate().all(|(i, &t)| i == t) {
            return in_order; // every token, in order (no top-k): nothing to pick out
        }
        tokens.iter().map(|&t| in_order[t]).collect()
    }
}

/// The Gumbel-max pick: the index `k` of the largest score `logits[candidates[k]] / T + g(u_k)`,
/// `g(u) = −ln(−ln u)`, the last of equal ones (as `Iterator::max_by`), and how many scores it
/// computed. Two logarithms a token were the largest part of a draw's cost at large vocabularies
/// (docs/design.md §7.33), and most tokens cannot win: with `s` the score of the largest logit, a
/// token whose gap `s − logit / T` exceeds its noise loses to it, and `g(u) < x` exactly when
/// `u < exp(−exp(−x))`. So the gaps are bucketed by eighths of a nat, each bucket's bound on `u`
/// computed once, and a token's score only where its `u` reaches its bucket's bound. The bounds
/// keep [`GUMBEL_MARGIN`] nats in hand, more than any rounding in the scores or the bounds, so the
/// pick is the one scoring every token gives (a test compares them).
fn gumbel_max(logits: &[f32], temperature: f64, candidates: &[usize], uniforms: &[f64]) -> (usize, usize) {
    let score = |k: usize| logits[candidates[k]] as f64 / temperature - (-uniforms[k].ln()).ln();
    // Any candidate's score would do as the first; the largest logit's is the hardest to beat.
    let mut top = 0;
    for (k, &t) in candidates.iter().enumerate() {
        if logits[t] > logits[candidates[top]] {
            top = k;
        }
    }
    let first = score(top);
    let bound = &*GUMBEL_BOUNDS;
    // The gaps only choose buckets: a product for the division, whose rounding the margin covers.
    let inverse = 1.0 / temperature;
    let (mut best, mut best_score, mut scored) = (top, first, 1);
    for (k, (&t, &u)) in candidates.iter().zip(uniforms).enumerate() {
        let gap = first - logits[t] as f64 * inverse - GUMBEL_MARGIN;
        // The noise never exceeds −ln(−ln(1 − 2⁻⁵³)) ≈ 36.7 (u < 1), past the last bucket's
        // reach (30 nats, where the bound is still 9e-14 below 1, far above f64's spacing).
        let may_win = gap <= 0.0 || (gap < 37.0 && u >= bound[((gap * 8.0) as usize).min(GUMBEL_BUCKETS - 1)]);
        if may_win && k != top {
            scored += 1;
            let s = score(k);
            if s.total_cmp(&best_score).is_ge() && (s != best_score || k > best) {
                (best, best_score) = (k, s);
            }
        }
    }
    (best, scored)
}

/// Buckets of an eighth of a nat each for [`gumbel_max`]'s bounds: gaps up to 30 nats.
const GUMBEL_BUCKETS: usize = 241;

/// Bucket b's bound: `g(u) < b / 8` exactly when `u < exp(−exp(−b / 8))`.
static GUMBEL_BOUNDS: std::sync::LazyLock<[f64; GUMBEL_BUCKETS]> =
    std::sync::LazyLock::new(|| std::array::from_fn(|b| (-(-(b as f64 / 8.0)).exp()).exp()));

/// Nats [`gumbel_max`] keeps in hand. Its bounds near 1 are exact to f64's spacing there, 1.1e-16,
/// which at the last bucket (30 nats: `1 − u` ≈ 9.4e-14) is 1.2e-3 nats of noise; the scores'
/// rounding is ~1e-14.
const GUMBEL_MARGIN: f64 = 0.01;

/// A top-p candidate: its logit (to rank it), its id (to rank equal logits) and its probability.
struct Ranked {
    logit: f32,
    token: usize,
    p: f64,
}

impl Ranked {
    /// [`rank_order`], the order top-k uses.
    fn rank(a: &Ranked, b: &Ranked) -> std::cmp::Ordering {
        rank_order((a.logit, a.token), (b.logit, b.token))
    }
}

/// The order top-k and top-p rank tokens in, as `(logit, id)`: larger logits first, equal ones
/// by id, so a kept set is a function of the logits alone.
fn rank_order(a: (f32, usize), b: (f32, usize)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Top-p's cut: moves the fewest highest-ranked tokens whose probabilities reach `top_p` to the
/// front and returns how many they are (all of them if the probabilities fall short of it by
/// rounding). Sorting all the tokens and summing down the order gives the same cut; this halves
/// the range that holds it by selection instead (linear time, where the sort was most of a
/// draw's cost at large vocabularies, docs/design.md §7.33), then sorts the last few.
fn nucleus(ranked: &mut [Ranked], top_p: f64) -> usize {
    // ranked[..lo] are the lo highest-ranked tokens, in any order, with mass `above`; the cut
    // falls in lo + 1 ..= hi.
    let (mut lo, mut hi, mut above) = (0, ranked.len(), 0.0);
    while hi - lo > 64 {
        let mid = lo + (hi - lo) / 2;
        ranked[lo..hi].select_nth_unstable_by(mid - lo, Ranked::rank);
        let mass: f64 = ranked[lo..mid].iter().map(|r| r.p).sum();
        if above + mass >= top_p {
            hi = mid;
        } else {
            above += mass;
            lo = mid;
        }
    }
    ranked[lo..hi].sort_unstable_by(Ranked::rank);
    for (i, r) in ranked[lo..hi].iter().enumerate() {
        above += r.p;
        if above >= top_p {
            return lo + i + 1;
        }
    }
    hi
}

/// The greedy pick: the first of the largest logits (0 when none is larger than -inf).
pub fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best })
        .0 as u32
}

/// Generates up to `max_new` tokens after `prompt`, calling `on_token` with each as it is made.
/// Stops early at the model's context length. Returns the new tokens.
///
/// Runs the fused decoder (`Decoder`) where it applies, else `Model::forward` with a KV cache
/// (quantised layers, probes, f64 or reference-kernel models); both give the same tokens.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    max_new: usize,
    sampler: &mut Sampler,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    check_prompt(prompt, model.config().max_seq_len)?;
    if Decoder::supports(model) {
        generate_fused(&Decoder::new(model)?, prompt, max_new, sampler, on_token)
    } else {
        generate_with_forward(model, prompt, max_new, sampler, on_token)
    }
}

/// An error unless `prompt` has at least one token and fits a context of `context` tokens.
pub fn check_prompt(prompt: &[u32], context: usize) -> Result<()> {
    if prompt.is_empty() {
        bail!("the prompt is empty: give at least one token of text");
    }
    if prompt.len() > context {
        bail!("the prompt is {} tokens long, longer than the model's context of {context} tokens", prompt.len());
    }
    Ok(())
}

/// `generate` on the fused decoder.
pub fn generate_fused(
    decoder: &Decoder,
    prompt: &[u32],
    max_new: usize,
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(max_new);
    if max_new == 0 {
        return Ok(out);
    }
    let mut seq = decoder.new_sequence();
    let mut logits = decoder.prefill(&mut seq, prompt)?;
    loop {
        let next = sampler.sample(&logits);
        on_token(next)?;
        out.push(next);
        if out.len() == max_new || seq.len() >= decoder.max_seq_len() {
            return Ok(out);
        }
        logits = decoder.step(&mut [&mut seq], &[next])?;
    }
}

/// What a speculative run did: how many draft tokens it proposed and how many the target kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculativeStats {
    /// Passes of the target over a token and its drafts.
    pub rounds: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl SpeculativeStats {
    /// Share of the drafted tokens the target kept (0 when none were drafted).
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// The draft `generate --speculative` and `difftx bench` use: the same model with bf16 weights
/// and a bf16 KV cache (about half the bytes a step reads; its greedy picks rarely differ from
/// f32's, docs/design.md §7.27).
pub fn bf16_draft(model: &Model) -> Result<Decoder> {
    let mut draft = Decoder::with_precision(model, WeightPrecision::Bf16)?;
    draft.set_kv_precision(KvPrecision::Bf16);
    Ok(draft)
}

/// Generation by speculative decoding: `draft` (a cheaper decoder of the same vocabulary, such as
/// the same model with bf16 weights) proposes up to `draft_len` tokens one at a time, each what
/// `sampler` would pick from the draft's logits at that index, and `target` checks them all in
/// one pass (`Decoder::extend`, one read of its weights), keeping the drafts up to the first that
/// `sampler` would not pick from the target's logits and its own pick after them. Every token is
/// the one `sampler` picks from `target`'s logits after the tokens before it (greedy or sampled:
/// a sampler's draw depends only on its seed, the token's index and the logits), so the output is
/// `generate_fused`'s on `target` with a sampler of the same parameters, whatever the draft
/// proposes (the draft only decides how many tokens a pass yields); the target's rows of a pass
/// are summed in another order than single steps, which could flip an exact tie. Stops at
/// `max_new` tokens or the target's context, as `generate_fused` does. docs/design.md §7.27 and
/// §7.32 have the measured rates.
pub fn generate_speculative(
    target: &Decoder,
    draft: &Decoder,
    prompt: &[u32],
    max_new: usize,
    draft_len: usize,
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculativeStats)> {
    let mut drafter = SpeculativeDraft::new(target, draft, prompt)?;
    if draft_len == 0 {
        bail!("the draft length must be at least 1 token (without drafts, use generate_fused)");
    }
    let mut stats = SpeculativeStats::default();
    let mut out = Vec::with_capacity(max_new);
    if max_new == 0 {
        return Ok((out, stats));
    }
    let mut seq = target.new_sequence();
    // The newest token: given out, in no cache yet.
    let mut next = sampler.sample(&target.prefill(&mut seq, prompt)?);
    loop {
        on_token(next)?;
        out.push(next);
        if out.len() == max_new || seq.len() >= target.max_seq_len() {
            return Ok((out, stats));
        }
        let pass = drafter.pass(target, draft, &mut seq, next, draft_len, max_new - out.len(), sampler)?;
        stats.add(&pass);
        let (last, kept) = pass.tokens.split_last().expect("a pass gives at least the target's own token");
        for &d in kept {
            on_token(d)?;
            out.push(d);
        }
        next = *last;
    }
}

/// What one pass of speculative decoding gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeculativePass {
    /// The tokens after the pass's newest token: the drafts the target kept, then its own pick
    /// after them (at least one token).
    pub tokens: Vec<u32>,
    pub drafted: usize,
    pub accepted: usize,
}

impl SpeculativeStats {
    /// Counts one pass.
    pub fn add(&mut self, pass: &SpeculativePass) {
        self.rounds += 1;
        self.drafted += pass.drafted;
        self.accepted += pass.accepted;
    }
}

/// The draft's side of one sequence decoded by speculative decoding, a pass at a time
/// (`generate_speculative`; the server, for a request decoded alone): the draft decoder's
/// cache, and the tokens of the sequence that cache has not seen yet, which it takes in one pass
/// before drafting. The target's cache belongs to the caller.
pub struct SpeculativeDraft {
    cache: SequenceCache,
    /// The sequence's tokens after those in `cache`, up to the last one in the target's cache.
    pending: Vec<u32>,
}

impl SpeculativeDraft {
    /// For a sequence whose tokens so far (those in the target's cache) are `history`. Nothing
    /// runs until the first pass. An error if the two decoders' vocabularies differ.
    pub fn new(target: &Decoder, draft: &Decoder, history: &[u32]) -> Result<Self> {
        if draft.vocab_size() != target.vocab_size() {
            bail!(
                "the draft's vocabulary ({} tokens) is not the target's ({})",
                draft.vocab_size(),
                target.vocab_size()
            );
        }
        Ok(SpeculativeDraft { cache: draft.new_sequence(), pending: history.to_vec() })
    }

    /// Records a token that entered the target's cache without a pass (a batched step).
    pub fn push(&mut self, token: u32) {
        self.pending.push(token);
    }

    /// One pass: the draft proposes up to `draft_len` tokens after `next` (the newest token, given
    /// out but in neither cache), those `sampler` picks from its logits, and `target` checks
    /// `next` and the drafts in one pass over `seq`, its cache of the sequence. `wanted` (one or
    /// more) bounds the tokens the pass may give: the drafts stop at `wanted - 1`, at the room
    /// left in either context, and at the first that `sampler` would not pick from the target's
    /// logits. `seq` then holds `next` and the kept drafts; the last token given is the next
    /// pass's `next`; `sampler` has counted the tokens given.
    #[allow(clippy::too_many_arguments)]
    pub fn pass(
        &mut self,
        target: &Decoder,
        draft: &Decoder,
        seq: &mut SequenceCache,
        next: u32,
        draft_len: usize,
        wanted: usize,
        sampler: &mut Sampler,
    ) -> Result<SpeculativePass> {
        let start = seq.len();
        if wanted == 0 || start >= target.max_seq_len() {
            bail!(
                "a speculative pass needs a token to give and room for it ({start} of {} positions cached)",
                target.max_seq_len()
            );
        }
        debug_assert_eq!(self.cache.len() + self.pending.len(), start, "the draft is out of step with the target");
        let vocab = target.vocab_size();
        // The draft caches the pending tokens, `next` and every draft but the last; a draft whose
        // context is shorter than the target's stops proposing once it is full.
        let k = draft_len
            .min(wanted - 1)
            .min(target.max_seq_len() - start - 1)
            .min(draft.max_seq_len().saturating_sub(start));
        // Draft i is the sampler's pick, i tokens ahead, from the draft's logits.
        let mut drafts = Vec::with_capacity(k);
        if k > 0 {
            self.pending.push(next);
            let mut logits = draft.append(&mut self.cache, &self.pending)?;
            self.pending.clear();
            loop {
                drafts.push(sampler.pick(&logits, drafts.len()));
                if drafts.len() == k {
                    break;
                }
                logits = draft.step(&mut [&mut self.cache], &drafts[drafts.len() - 1..])?;
            }
        }
        // The target's logits after `next` and after each draft, and its picks from them.
        let mut rows = Vec::with_capacity(k + 1);
        rows.push(next);
        rows.extend_from_slice(&drafts);
        let logits = target.extend(seq, &rows)?;
        let mut picks = logits.chunks_exact(vocab).enumerate().map(|(i, row)| sampler.pick(row, i));
        // Drafts up to the first the target would not have picked, then its own pick.
        let mut kept = 0;
        let last = loop {
            let pick = picks.next().expect("a row per draft and one after them");
            if kept == k || drafts[kept] != pick {
                break pick;
            }
            kept += 1;
        };
        sampler.advance(kept + 1);
        // Both caches keep `next` and the kept drafts; the target's pick after them comes next.
        seq.truncate(start + 1 + kept);
        if k > 0 {
            // (With every draft kept the draft's cache lacks the last one.)
            self.cache.truncate(start + 1 + kept);
            if kept == k {
                self.pending.push(drafts[k - 1]);
            }
        } else {
            self.pending.push(next);
        }
        let mut tokens = drafts[..kept].to_vec();
        tokens.push(last);
        Ok(SpeculativePass { tokens, drafted: k, accepted: kept })
    }
}

/// `generate` through `Model::forward` with a KV cache (the general path).
pub fn generate_with_forward(
    model: &Model,
    prompt: &[u32],
    max_new: usize,
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    let ctx = model.config().max_seq_len;
    let mut cache = KvCache::new(model.config());
    let device = model.device();
    let mut out = Vec::with_capacity(max_new);
    let mut input = Tensor::new(prompt, device)?.unsqueeze(0)?;
    for _ in 0..max_new {
        if cache.seq_len() + input.dim(1)? > ctx {
            break;
        }
        let logits = model.forward(&input, Some(&mut cache))?;
        let next = sampler.sample(&last_logits(&logits)?);
        on_token(next)?;
        out.push(next);
        if cache.seq_len() >= ctx {
            break;
        }
        input = Tensor::new(&[next], device)?.unsqueeze(0)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() }).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_restricts() {
        let logits = [0.0f32, 5.0, 4.9, -3.0];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: Some(1), top_p: None, seed: 3 }).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: None, top_p: Some(0.9), seed: 3 }).unwrap();
        for _ in 0..200 {
            let t = s.sample(&logits);
            assert!(t == 1 || t == 2, "token {t} is outside the top-p nucleus");
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let params = SamplingParams { temperature: 1.0, top_k: None, top_p: None, seed: 11 };
        let mut s = Sampler::new(params.clone()).unwrap();
        let draws: Vec<u32> = (0..4000).map(|_| s.sample(&logits)).collect();
        let ones = draws.iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "frequency {ones}");
        let mut again = Sampler::new(params).unwrap();
        let draws2: Vec<u32> = (0..4000).map(|_| again.sample(&logits)).collect();
        assert_eq!(draws, draws2);
    }

    /// Gumbel-max draws under temperature, top-k and top-p: each candidate as often as its
    /// probability in `distribution`, nothing else ever.
    #[test]
    fn draws_follow_the_distribution_under_top_k_and_top_p() {
        let logits = [0.3f32, -1.0, 2.0, 1.1, f32::NEG_INFINITY, 0.9, -0.2, 1.7, -3.0];
        for (top_k, top_p) in [(None, None), (Some(5), None), (None, Some(0.8)), (Some(6), Some(0.9))] {
            let params = SamplingParams { temperature: 0.7, top_k, top_p, seed: 21 };
            let mut s = Sampler::new(params).unwrap();
            let dist = s.distribution(&logits);
            assert!((dist.iter().map(|d| d.1).sum::<f64>() - 1.0).abs() < 1e-12);
            let n = 40_000;
            let mut counts = vec![0usize; logits.len()];
            for _ in 0..n {
                counts[s.sample(&logits) as usize] += 1;
            }
            for (token, &count) in counts.iter().enumerate() {
                let p = dist.iter().find(|d| d.0 == token as u32).map_or(0.0, |d| d.1);
                let freq = count as f64 / n as f64;
                // Four standard errors at most (the largest is 0.0025).
                assert!((freq - p).abs() < 0.01, "{top_k:?} {top_p:?}: token {token} drawn {freq}, p = {p}");
                if p == 0.0 {
                    assert_eq!(count, 0, "{top_k:?} {top_p:?}: token {token} is not a candidate");
                }
            }
        }
    }

    /// A draw depends on the seed, the token's index and the logits only: `pick` ahead of time
    /// gives what `sample` gives at that index, and another seed other tokens.
    #[test]
    fn a_draw_depends_on_the_seed_and_the_index_only() {
        let params = SamplingParams { temperature: 1.0, top_k: None, top_p: Some(0.95), seed: 4 };
        let rows: Vec<Vec<f32>> =
            (0..50).map(|i| (0..30).map(|j| ((i * 7 + j * 13) % 11) as f32 * 0.3).collect()).collect();
        let mut s = Sampler::new(params.clone()).unwrap();
        let sampled: Vec<u32> = rows.iter().map(|r| s.sample(r)).collect();
        let mut ahead = Sampler::new(params.clone()).unwrap();
        ahead.sample(&rows[0]);
        let picked: Vec<u32> = rows[1..].iter().enumerate().map(|(i, r)| ahead.pick(r, i)).collect();
        assert_eq!(picked, sampled[1..]);
        ahead.advance(rows.len() - 1);
        assert_eq!(ahead.sample(&rows[0]), s.sample(&rows[0]));
        let mut other = Sampler::new(SamplingParams { seed: 5, ..params }).unwrap();
        let other_draws: Vec<u32> = rows.iter().map(|r| other.sample(r)).collect();
        assert_ne!(other_draws, sampled);
    }

    /// The Gumbel-max pick that skips tokens which cannot win is the pick of scoring every
    /// candidate (`logit / T − ln(−ln u)`, the last of equal maxima): flat, near-flat, tied,
    /// spread and extreme logits, temperatures from 0.05 to 5, with and without top-k. And it
    /// does skip: on spread logits at a 40,000-token vocabulary it scores under a tenth of them.
    #[test]
    fn the_gumbel_pick_is_that_of_scoring_every_token() {
        let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(3);
        for vocab in [1usize, 2, 5, 300, 5000, 40_000] {
            for spread in ["flat", "near-flat", "tied", "spread", "extreme"] {
                let logits: Vec<f32> = (0..vocab)
                    .map(|_| match spread {
                        "flat" => 1.5,
                        "near-flat" => rng.random_range(0.0f32..1e-3),
                        "tied" => rng.random_range(0..4) as f32,
                        "spread" => rng.random_range(-8.0f32..8.0),
                        _ => rng.random_range(-300.0f32..300.0),
                    })
                    .collect();
                for temperature in [0.05, 0.7, 1.0, 5.0] {
                    for top_k in [None, Some(3), Some(1000)] {
                        let params = SamplingParams { temperature, top_k, top_p: None, seed: vocab as u64 };
                        let sampler = Sampler::new(params).unwrap();
                        let (candidates, _) = sampler.candidates(&logits);
                        let (mut scored, mut draws) = (0, 0);
                        for ahead in 0..(200_000 / vocab).clamp(3, 60) {
                            let u = uniforms(vocab as u64, ahead as u64, &candidates, false);
                            let scores = candidates
                                .iter()
                                .zip(&u)
                                .map(|(&t, u)| (t, logits[t] as f64 / temperature - (-u.ln()).ln()));
                            let expected = scores.max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0 as u32;
                            let what = format!("vocab {vocab} {spread} T {temperature} {top_k:?} index {ahead}");
                            assert_eq!(sampler.pick(&logits, ahead), expected, "{what}");
                            let (k, count) = gumbel_max(&logits, temperature, &candidates, &u);
                            assert_eq!(candidates[k] as u32, expected, "{what}");
                            (scored, draws) = (scored + count, draws + 1);
                        }
                        if vocab == 40_000 && spread == "spread" && top_k.is_none() && temperature <= 1.0 {
                            assert!(scored * 10 < draws * vocab, "T {temperature}: {scored} scores in {draws} draws");
                        }
                    }
                }
            }
        }
    }

    /// Top-k and top-p's candidates as first written: every finite token sorted by logit (equal
    /// logits by id), the first k, then the shortest prefix whose probabilities reach p.
    fn candidates_by_sorting(params: &SamplingParams, logits: &[f32]) -> Vec<(usize, f64)> {
        let mut idx: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
        idx.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
        idx.truncate(params.top_k.unwrap_or(usize::MAX));
        let max = idx.first().map_or(0.0, |&i| logits[i] as f64);
        let weights: Vec<f64> = idx.iter().map(|&i| ((logits[i] as f64 - max) / params.temperature).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let mut kept = Vec::new();
        for (&i, w) in idx.iter().zip(weights) {
            kept.push((i, w / total));
            acc += w / total;
            if acc >= params.top_p.unwrap_or(2.0) {
                break;
            }
        }
        kept
    }

    /// Top-p's cut by selection keeps the tokens, with the probabilities, that sorting keeps: at
    /// vocabularies from none to 50,000 tokens, spread and heavily tied logits, -inf among them,
    /// nuclei from one token to nearly all, with and without top-k.
    #[test]
    fn the_nucleus_by_selection_is_the_sorted_prefix() {
        let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(7);
        let mut cases = 0;
        for vocab in [0usize, 1, 2, 63, 64, 65, 200, 1000, 4099, 50_000] {
            for tied in [false, true] {
                let logits: Vec<f32> = (0..vocab)
                    .map(|_| match rng.random_range(0..50) {
                        0 => f32::NEG_INFINITY,
                        _ if tied => rng.random_range(0..12) as f32 * 0.5,
                        _ => rng.random_range(-6.0f32..6.0),
                    })
                    .collect();
                for temperature in [0.3, 1.0, 3.0] {
                    for top_k in [None, Some(1), Some(70), Some(3000)] {
                        // Not round numbers: with equal probabilities (tied logits under top-k)
                        // a round p can equal k tokens' mass, and the cut then depends on the
                        // order the probabilities are summed in, which differs by rounding.
                        for top_p in [0.0123457, 0.3001234, 0.5000321, 0.9000123, 0.9899877, 0.9999123] {
                            let params = SamplingParams { temperature, top_k, top_p: Some(top_p), seed: 0 };
                            let (tokens, probs) = Sampler::new(params.clone()).unwrap().candidates(&logits);
                            let mut kept: Vec<(usize, f64)> = tokens.into_iter().zip(probs.unwrap()).collect();
                            kept.sort_by_key(|k| k.0);
                            let mut expected = candidates_by_sorting(&params, &logits);
                            expected.sort_by_key(|k| k.0);
                            let what = format!("vocab {vocab} tied {tied} T {temperature} {top_k:?} {top_p}");
                            assert_eq!(kept.len(), expected.len(), "{what}");
                            for (a, b) in kept.iter().zip(&expected) {
                                assert_eq!(a.0, b.0, "{what}");
                                assert!((a.1 - b.1).abs() <= 1e-12 * b.1.max(1e-300), "{what}: {a:?} {b:?}");
                            }
                            cases += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(cases, 10 * 2 * 3 * 4 * 6);
    }

    /// Seeking to a token's uniform gives the value the stream read in order gives.
    #[test]
    fn uniforms_by_seeking_are_those_read_in_order() {
        let tokens = [0usize, 7, 8, 31, 32, 63, 64, 65, 200, 4095, 3];
        for (seed, index) in [(0u64, 0u64), (9, 1), (u64::MAX, 12345)] {
            let a = uniforms(seed, index, &tokens, true);
            assert_eq!(a, uniforms(seed, index, &tokens, false));
            assert!(a.iter().all(|u| (0.0..1.0).contains(u)));
            assert_ne!(a, uniforms(seed, index + 1, &tokens, true));
        }
    }

    /// A batch's draws, split over the team or in turn, are each request's own draws in turn:
    /// 6 rows of 20,000 tokens (split) and of 300 (in turn), sampled and greedy requests mixed.
    #[test]
    fn a_batch_draws_what_each_request_draws_alone() {
        for vocab in [20_000usize, 300] {
            let rows = 6;
            let logits: Vec<f32> = (0..rows * vocab).map(|i| ((i * 7919 % 1009) as f32 * 0.37).sin() * 6.0).collect();
            let params = |r: usize| SamplingParams {
                temperature: if r == 2 { 0.0 } else { 0.5 + r as f64 * 0.2 },
                top_k: (r == 3).then_some(50),
                top_p: (r == 4).then_some(0.9),
                seed: r as u64,
            };
            let mut batch: Vec<Sampler> = (0..rows).map(|r| Sampler::new(params(r)).unwrap()).collect();
            let mut alone: Vec<Sampler> = (0..rows).map(|r| Sampler::new(params(r)).unwrap()).collect();
            for _ in 0..5 {
                let mut refs: Vec<&mut Sampler> = batch.iter_mut().collect();
                let drawn = sample_rows(&mut refs, &logits);
                let expected: Vec<u32> =
                    alone.iter_mut().zip(logits.chunks_exact(vocab)).map(|(s, row)| s.sample(row)).collect();
                assert_eq!(drawn, expected, "vocab {vocab}");
            }
        }
    }

    /// A sampler limited to the tokenizer's ids never draws past them, greedy or sampled, even
    /// where the ids past them have the largest logits; below them it draws as before.
    #[test]
    fn a_limited_sampler_draws_only_the_tokenizers_ids() {
        let logits: Vec<f32> = (0..400).map(|i| if i >= 256 { 9.0 } else { (i as f32 * 0.7).sin() }).collect();
        for params in [
            SamplingParams { temperature: 0.0, ..Default::default() },
            SamplingParams { temperature: 1.0, top_k: None, top_p: None, seed: 2 },
            SamplingParams { temperature: 1.0, top_k: Some(20), top_p: Some(0.9), seed: 2 },
        ] {
            let limited = Sampler::new(params.clone()).unwrap().limited_to(256);
            let free = Sampler::new(params.clone()).unwrap();
            for ahead in 0..200 {
                assert!(limited.pick(&logits, ahead) < 256, "{params:?}");
                assert_eq!(limited.pick(&logits, ahead), free.pick(&logits[..256], ahead), "{params:?}");
            }
            assert!(limited.distribution(&logits).iter().all(|d| d.0 < 256));
            assert!(free.pick(&logits, 0) >= 256, "the test's extra ids must be the likely ones");
        }
    }

    /// Top-p 1 draws what no top-p draws, token for token.
    #[test]
    fn top_p_one_is_no_top_p() {
        let logits: Vec<f32> = (0..3000).map(|i| ((i * 37 % 101) as f32 * 0.13).sin() * 4.0).collect();
        let with = Sampler::new(SamplingParams { temperature: 0.9, top_k: None, top_p: Some(1.0), seed: 8 }).unwrap();
        let without = Sampler::new(SamplingParams { temperature: 0.9, top_k: None, top_p: None, seed: 8 }).unwrap();
        let (mut a, mut b) = (with.distribution(&logits), without.distribution(&logits));
        a.sort_by_key(|d| d.0);
        b.sort_by_key(|d| d.0);
        assert_eq!(a.len(), b.len());
        assert!(a.iter().zip(&b).all(|(x, y)| x.0 == y.0 && (x.1 - y.1).abs() < 1e-12));
        for ahead in 0..50 {
            assert_eq!(with.pick(&logits, ahead), without.pick(&logits, ahead));
        }
    }

    #[test]
    fn bad_params_are_rejected() {
        assert!(Sampler::new(SamplingParams { temperature: -1.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { top_p: Some(1.5), ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { top_k: Some(0), ..Default::default() }).is_err());
    }
}
