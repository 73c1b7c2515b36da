//! Autoregressive generation with a KV cache: greedy, temperature, top-k and top-p sampling, and
//! greedy speculative decoding.

use crate::model::decode::Decoder;
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

pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
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
        let rng = rand::rngs::StdRng::seed_from_u64(params.seed);
        Ok(Sampler { params, rng })
    }

    /// Picks the next token from one position's logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        // Candidates sorted by logit, cut by top-k, then softmax at the temperature, then top-p.
        let mut idx: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
        if idx.is_empty() {
            return argmax(logits);
        }
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if let Some(k) = self.params.top_k {
            idx.truncate(k);
        }
        let max = logits[idx[0]] as f64;
        let mut probs: Vec<f64> =
            idx.iter().map(|&i| ((logits[i] as f64 - max) / self.params.temperature).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if let Some(top_p) = self.params.top_p {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    acc += p;
                    acc >= top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            idx.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (p, &i) in probs.iter().zip(&idx) {
            r -= p;
            if r <= 0.0 {
                return i as u32;
            }
        }
        *idx.last().unwrap() as u32
    }
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
    let ctx = model.config().max_seq_len;
    if prompt.is_empty() {
        bail!("the prompt is empty: give at least one token of text");
    }
    if prompt.len() > ctx {
        bail!("the prompt is {} tokens long, longer than the model's context of {ctx} tokens", prompt.len());
    }
    if Decoder::supports(model) {
        generate_fused(&Decoder::new(model)?, prompt, max_new, sampler, on_token)
    } else {
        generate_with_forward(model, prompt, max_new, sampler, on_token)
    }
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

/// Greedy generation by speculative decoding: `draft` (a cheaper decoder of the same vocabulary,
/// such as the same model with bf16 weights) proposes up to `draft_len` tokens one at a time,
/// and `target` checks them all in one pass (`Decoder::extend`, one read of its weights), keeping
/// the drafts up to the first it would not have picked and its own token after them. Every token
/// is the target's argmax after the tokens before it, so the output is `generate_fused`'s with a
/// greedy sampler on `target`, whatever the draft proposes (the draft only decides how many tokens
/// a pass yields); the target's rows of a pass are summed in another order than single steps,
/// which could flip an exact tie. Stops at `max_new` tokens or the target's context, as
/// `generate_fused` does. docs/design.md §7.27 has the measured rates.
pub fn generate_speculative(
    target: &Decoder,
    draft: &Decoder,
    prompt: &[u32],
    max_new: usize,
    draft_len: usize,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculativeStats)> {
    if draft.vocab_size() != target.vocab_size() {
        bail!("the draft's vocabulary ({} tokens) is not the target's ({})", draft.vocab_size(), target.vocab_size());
    }
    if draft_len == 0 {
        bail!("the draft length must be at least 1 token (without drafts, use generate_fused)");
    }
    let vocab = target.vocab_size();
    let mut stats = SpeculativeStats::default();
    let mut out = Vec::with_capacity(max_new);
    if max_new == 0 {
        return Ok((out, stats));
    }
    let (mut seq, mut draft_seq) = (target.new_sequence(), draft.new_sequence());
    // `next`: the newest token, given out but in neither cache yet; `pending`: the tokens the
    // draft's cache lacks, `next` last.
    let mut next = argmax(&target.prefill(&mut seq, prompt)?);
    // A draft with a shorter context than the target's stops proposing once it is full.
    if prompt.len() <= draft.max_seq_len() {
        draft.prefill(&mut draft_seq, prompt)?;
    }
    let mut pending = vec![next];
    loop {
        on_token(next)?;
        out.push(next);
        if out.len() == max_new || seq.len() >= target.max_seq_len() {
            return Ok((out, stats));
        }
        // Drafts beyond what may still be given out, or past either context, would be wasted.
        let room = (max_new - out.len()).min(target.max_seq_len() - seq.len()) - 1;
        // The draft caches `pending` and all its drafts but the last.
        let draft_needs = draft_seq.len() + pending.len();
        let k = if !draft_seq.is_empty() && draft_needs <= draft.max_seq_len() {
            draft_len.min(room).min(draft.max_seq_len() - draft_needs + 1)
        } else {
            0
        };
        let mut drafts = Vec::with_capacity(k);
        if k > 0 {
            let logits = draft.extend(&mut draft_seq, &pending)?;
            drafts.push(argmax(&logits[logits.len() - vocab..]));
            while drafts.len() < k {
                let logits = draft.step(&mut [&mut draft_seq], &drafts[drafts.len() - 1..])?;
                drafts.push(argmax(&logits));
            }
        }
        // The target's logits after `next` and after each draft.
        let start = seq.len();
        let mut rows = Vec::with_capacity(k + 1);
        rows.push(next);
        rows.extend_from_slice(&drafts);
        let logits = target.extend(&mut seq, &rows)?;
        let picks: Vec<u32> = logits.chunks_exact(vocab).map(argmax).collect();
        // Drafts up to the first the target would not have picked.
        let kept = drafts.iter().zip(&picks).take_while(|(d, p)| d == p).count();
        stats.rounds += 1;
        stats.drafted += k;
        stats.accepted += kept;
        for &d in &drafts[..kept] {
            on_token(d)?;
            out.push(d);
        }
        // The target keeps `next` and the kept drafts; its own pick after them comes next.
        seq.truncate(start + 1 + kept);
        next = picks[kept];
        if k > 0 {
            // The draft cached `pending` and its drafts but the last: it keeps what was kept.
            let cached = draft_seq.len() - (pending.len() + k - 1);
            draft_seq.truncate(cached + pending.len() + kept.min(k - 1));
            pending = if kept == k { vec![drafts[k - 1], next] } else { vec![next] };
        } else {
            // No draft this pass (the draft's context is full, or this is the last token).
            pending.push(next);
        }
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

    #[test]
    fn bad_params_are_rejected() {
        assert!(Sampler::new(SamplingParams { temperature: -1.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { top_p: Some(1.5), ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { top_k: Some(0), ..Default::default() }).is_err());
    }
}
