//! Autoregressive generation with a KV cache: greedy, temperature, top-k and top-p sampling.

use crate::model::decode::Decoder;
use crate::model::{last_logits, KvCache, Model};
use anyhow::{bail, Result};
use candle_core::Tensor;
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
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best })
                .0 as u32
        };
        if self.params.temperature == 0.0 {
            return argmax();
        }
        // Candidates sorted by logit, cut by top-k, then softmax at the temperature, then top-p.
        let mut idx: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
        if idx.is_empty() {
            return argmax();
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
