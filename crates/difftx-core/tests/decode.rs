//! The fused decoder against the full forward pass (itself checked against an f64 reference in
//! reference.rs): logits of every position within 1e-4, greedy tokens identical, batched steps of
//! sequences at different positions equal to single ones, on every family and layout variant.

use candle_core::{DType, Device, Tensor};
use difftx_core::config::{Family, HeadPairing, ModelConfig, RopeStyle};
use difftx_core::generate::{
    bf16_draft, generate_fused, generate_speculative, generate_with_forward, Sampler, SamplingParams, SpeculativeDraft,
};
use difftx_core::model::RunOptions;
use difftx_core::model::{init_weights, Model};
use difftx_core::ops::{Kernels, Precision};
use difftx_core::{Decoder, KvPrecision, WeightFormat, WeightPrecision};
use difftx_kernels::decode::{int8_code, int8_scale};
use std::collections::HashMap;

fn model(cfg: &ModelConfig, seed: u64) -> Model {
    let w: HashMap<String, Tensor> = init_weights(cfg, seed, DType::F32, &Device::Cpu).unwrap().into_iter().collect();
    Model::from_weights(cfg, &w).unwrap()
}

/// Small configs covering what the decoder branches on: family, GQA, head pairing, RoPE style,
/// the sub-layer norm's variants, untied and tied heads, a head dim other than D/H.
fn configs() -> Vec<(String, ModelConfig)> {
    let mut out = Vec::new();
    for family in Family::ALL {
        let mut base = ModelConfig::preset("nano", family).unwrap();
        base.vocab_size = 61;
        base.d_model = 48;
        base.n_layers = 2;
        base.n_heads = 4;
        base.n_kv_heads = 4;
        base.d_ff = 80;
        // Over two chunks of the cache (difftx_kernels::decode::KV_CHUNK, 64 positions).
        base.max_seq_len = 150;
        // Large enough that attention is far from uniform (the default init keeps it flat).
        base.init_std = 0.35;
        base.lambda_std = 0.3;
        out.push((format!("{family:?}"), base.clone()));
        let mut gqa = base.clone();
        gqa.n_kv_heads = 2;
        gqa.rope_style = RopeStyle::RotateHalf;
        gqa.head_dim = Some(10);
        gqa.tie_embeddings = true;
        out.push((format!("{family:?} gqa rotate-half d10 tied"), gqa));
        if family == Family::DiffV1 {
            let mut halves = base.clone();
            halves.head_pairing = HeadPairing::Halves;
            halves.subln_affine = false;
            out.push(("DiffV1 halves, norm without gain".into(), halves));
            let mut off = base.clone();
            off.subln = false;
            out.push(("DiffV1 without sub-layer norm".into(), off));
        }
    }
    out
}

fn tokens(n: usize, vocab: usize, seed: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7 + seed * 13 + i * i) % vocab) as u32).collect()
}

/// A greedy sampler (temperature 0).
fn greedy() -> Sampler {
    Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() }).unwrap()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn decoder_logits_match_the_full_forward_at_every_position() {
    for (name, cfg) in configs() {
        let m = model(&cfg, 5);
        let ids = tokens(cfg.max_seq_len, cfg.vocab_size, 1);
        let full = m.forward(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(), None).unwrap();
        let full = full.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
        let dec = Decoder::new(&m).unwrap();
        let mut seq = dec.new_sequence();
        let prompt = 5;
        let first = dec.prefill(&mut seq, &ids[..prompt]).unwrap();
        let scale = full.iter().flatten().fold(1.0f32, |a, v| a.max(v.abs()));
        assert!(max_abs(&first, &full[prompt - 1]) <= 1e-4 * scale, "{name}: prefill");
        for t in prompt..cfg.max_seq_len {
            let logits = dec.step(&mut [&mut seq], &[ids[t]]).unwrap();
            let err = max_abs(&logits, &full[t]);
            assert!(err <= 1e-4 * scale, "{name}: position {t}: max |diff| {err} (logits up to {scale})");
        }
        assert_eq!(seq.len(), cfg.max_seq_len);
        // The whole context as one prompt: every position a row of one pass.
        let mut whole = dec.new_sequence();
        let last = dec.prefill(&mut whole, &ids).unwrap();
        assert!(max_abs(&last, &full[cfg.max_seq_len - 1]) <= 1e-4 * scale, "{name}: prefill of the context");
        // The context is full: one more step is an error, not a panic.
        let err = dec.step(&mut [&mut seq], &[0]).unwrap_err().to_string();
        assert!(err.contains("context"), "{err}");
    }
}

#[test]
fn batched_steps_equal_single_steps_at_different_positions() {
    // Attention of a pass on one thread, and split over threads; every cache precision; f32
    // weights, and bf16 (whose products take the rows in groups of up to four).
    for (name, cfg) in configs() {
        for threshold in [usize::MAX, 0] {
            for (kv, weights) in [
                (KvPrecision::F32, WeightPrecision::F32),
                (KvPrecision::Bf16, WeightPrecision::F32),
                (KvPrecision::Bf16, WeightPrecision::Bf16),
                (KvPrecision::Int8, WeightPrecision::F32),
            ] {
                let case = format!("{name}, split from {threshold}, {kv:?} cache, {weights:?} weights");
                batched_equals_single(&case, &cfg, threshold, kv, weights);
            }
        }
    }
}

fn batched_equals_single(
    name: &str,
    cfg: &ModelConfig,
    parallel_from: usize,
    kv: KvPrecision,
    weights: WeightPrecision,
) {
    let m = model(cfg, 9);
    let mut dec = Decoder::with_precision(&m, weights).unwrap();
    dec.set_parallel_attention_macs(parallel_from);
    dec.set_kv_precision(kv);
    // The second sequence's steps cross from the cache's first chunk into its second.
    let prompts = [tokens(3, cfg.vocab_size, 2), tokens(61, cfg.vocab_size, 3), tokens(1, cfg.vocab_size, 4)];
    let next = [tokens(6, cfg.vocab_size, 5), tokens(6, cfg.vocab_size, 6), tokens(6, cfg.vocab_size, 7)];
    // One at a time.
    let mut single = Vec::new();
    for (p, nx) in prompts.iter().zip(&next) {
        let mut seq = dec.new_sequence();
        dec.prefill(&mut seq, p).unwrap();
        single.push(nx.iter().map(|&t| dec.step(&mut [&mut seq], &[t]).unwrap()).collect::<Vec<_>>());
    }
    // All three in each step.
    let mut seqs: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut s = dec.new_sequence();
            dec.prefill(&mut s, p).unwrap();
            s
        })
        .collect();
    for i in 0..6 {
        let toks: Vec<u32> = next.iter().map(|n| n[i]).collect();
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let logits = dec.step(&mut refs, &toks).unwrap();
        for (r, row) in logits.chunks_exact(cfg.vocab_size).enumerate() {
            let err = max_abs(row, &single[r][i]);
            assert!(err < 1e-5, "{name}: sequence {r} step {i}: {err}");
        }
    }
}

#[test]
fn one_sequence_with_its_heads_split_over_threads_matches_the_full_forward() {
    // With two threads or more (the team's participants), a single sequence's heads (diff-v1's
    // pairs) are tasks of their own, dealt out over the threads; prefill (three rows) and single
    // steps both split.
    for (name, cfg) in configs() {
        let m = model(&cfg, 11);
        let ids = tokens(cfg.max_seq_len, cfg.vocab_size, 4);
        let full = m.forward(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(), None).unwrap();
        let full = full.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
        let scale = full.iter().flatten().fold(1.0f32, |a, v| a.max(v.abs()));
        let logits = |parallel_from: usize| {
            let mut dec = Decoder::new(&m).unwrap();
            dec.set_parallel_attention_macs(parallel_from);
            let mut seq = dec.new_sequence();
            let mut out = vec![dec.prefill(&mut seq, &ids[..3]).unwrap()];
            for &t in &ids[3..] {
                out.push(dec.step(&mut [&mut seq], &[t]).unwrap());
            }
            out
        };
        let split = logits(0);
        for (t, row) in split.iter().enumerate() {
            let err = max_abs(row, &full[t + 2]);
            assert!(err <= 1e-4 * scale, "{name}: position {}: max |diff| {err}", t + 2);
        }
        // Each head's arithmetic is the same on whichever thread runs it.
        assert_eq!(split, logits(usize::MAX), "{name}");
    }
}

#[test]
fn greedy_tokens_are_those_of_the_forward_path() {
    for (name, cfg) in configs() {
        let m = model(&cfg, 3);
        let prompt = tokens(4, cfg.vocab_size, 8);
        let slow = generate_with_forward(&m, &prompt, cfg.max_seq_len, &mut greedy(), |_| Ok(())).unwrap();
        let fast =
            generate_fused(&Decoder::new(&m).unwrap(), &prompt, cfg.max_seq_len, &mut greedy(), |_| Ok(())).unwrap();
        // The last position's logits still give one token past the context.
        assert_eq!(slow.len(), cfg.max_seq_len - prompt.len() + 1, "{name}: stops at the context");
        assert_eq!(fast, slow, "{name}");
    }
}

/// A bf16 cache moves the logits by bf16 rounding: about as far as bf16 weights do (the rounding
/// the decoder already offers), far less than a misread cache would, and not zero. An int8 cache
/// (a step of 1/127 of each position's largest value) moves them further, about as far as int8
/// weights (a step of 1/127 of each output channel's largest weight) do.
#[test]
fn reduced_kv_caches_move_the_logits_as_far_as_weights_of_that_precision_do() {
    for (name, cfg) in configs() {
        let m = model(&cfg, 6);
        let ids = tokens(cfg.max_seq_len, cfg.vocab_size, 5);
        let cache_of = |kv: KvPrecision| {
            let mut dec = Decoder::new(&m).unwrap();
            dec.set_kv_precision(kv);
            assert_eq!(dec.kv_precision(), kv);
            dec
        };
        // Every position's logits: the prompt's last, then one per step (crossing a chunk).
        let run = |dec: &Decoder| {
            let mut seq = dec.new_sequence();
            let mut out = vec![dec.prefill(&mut seq, &ids[..7]).unwrap()];
            for &t in &ids[7..] {
                out.push(dec.step(&mut [&mut seq], &[t]).unwrap());
            }
            out
        };
        let exact = run(&Decoder::new(&m).unwrap());
        let scale = exact.iter().flatten().fold(1.0f32, |m, v| m.max(v.abs()));
        // Mean and worst over positions of the largest |difference| from f32, over `scale`.
        let off = |run: &[Vec<f32>]| {
            let per: Vec<f32> = run.iter().zip(&exact).map(|(a, b)| max_abs(a, b) / scale).collect();
            (per.iter().sum::<f32>() / per.len() as f32, per.iter().cloned().fold(0.0, f32::max))
        };
        let (mean, worst) = off(&run(&cache_of(KvPrecision::Bf16)));
        let (weights_mean, _) = off(&run(&Decoder::with_precision(&m, WeightPrecision::Bf16).unwrap()));
        let (int8_mean, int8_worst) = off(&run(&cache_of(KvPrecision::Int8)));
        let (int8_weights_mean, _) = off(&run(&Decoder::with_precision(&m, WeightPrecision::Int8).unwrap()));
        // Measured (these deliberately sharp models, logits up to ~10): mean 5.0e-3-7.3e-3, worst
        // 2.1e-2-4.3e-2, 0.5-0.55 of bf16 weights' mean (their products round the inputs too).
        assert!(mean > 0.0, "{name}: a bf16 cache changed nothing: is it rounded at all?");
        assert!(mean < 2e-2 && worst < 1e-1, "{name}: bf16 cache off by {mean} on average, {worst} at worst");
        assert!(mean < 1.5 * weights_mean, "{name}: bf16 cache {mean} against bf16 weights {weights_mean}");
        // Measured: mean 1.0e-2-1.7e-2, worst 4.2e-2-7.0e-2; 1.9-2.3 times the bf16 cache's mean,
        // 0.43-0.52 of int8 weights'.
        assert!(int8_mean > mean, "{name}: an int8 cache ({int8_mean}) closer than a bf16 one ({mean})?");
        assert!(
            int8_mean < 3e-2 && int8_worst < 0.15,
            "{name}: int8 cache off by {int8_mean} on average, {int8_worst} at worst"
        );
        assert!(
            int8_mean < int8_weights_mean,
            "{name}: int8 cache {int8_mean} against int8 weights {int8_weights_mean}"
        );
    }
}

#[test]
fn a_cache_of_another_precision_is_refused_and_prefill_replaces_it() {
    let cfg = ModelConfig::preset("nano", Family::DiffV2).unwrap();
    let m = model(&cfg, 2);
    let mut dec = Decoder::new(&m).unwrap();
    let mut f32_seq = dec.new_sequence();
    dec.prefill(&mut f32_seq, &[1, 2]).unwrap();
    dec.set_kv_precision(KvPrecision::Bf16);
    let err = dec.step(&mut [&mut f32_seq], &[3]).unwrap_err().to_string();
    assert!(err.contains("KV precision"), "{err}");
    // prefill starts the sequence over at the decoder's precision.
    dec.prefill(&mut f32_seq, &[1, 2]).unwrap();
    dec.step(&mut [&mut f32_seq], &[3]).unwrap();
    // An int8 decoder refuses the bf16 cache in turn.
    dec.set_kv_precision(KvPrecision::Int8);
    let err = dec.step(&mut [&mut f32_seq], &[4]).unwrap_err().to_string();
    assert!(err.contains("KV precision (Int8)"), "{err}");
}

#[test]
fn decoder_refuses_what_it_does_not_run_and_bad_tokens() {
    let cfg = ModelConfig::preset("nano", Family::DiffV1).unwrap();
    let mut m = model(&cfg, 1);
    let dec = Decoder::new(&m).unwrap();
    let mut seq = dec.new_sequence();
    dec.prefill(&mut seq, &[1, 2]).unwrap();
    let err = dec.step(&mut [&mut seq], &[cfg.vocab_size as u32]).unwrap_err().to_string();
    assert!(err.contains("vocabulary"), "{err}");
    assert!(dec.prefill(&mut seq, &[]).is_err());
    drop(dec);
    m.quantize_weights(WeightFormat::Q8_0).unwrap();
    assert!(!Decoder::supports(&m));
    assert!(Decoder::new(&m).is_err());
    let w: HashMap<String, Tensor> = init_weights(&cfg, 1, DType::F64, &Device::Cpu).unwrap().into_iter().collect();
    assert!(!Decoder::supports(&Model::from_weights(&cfg, &w).unwrap()));
}

/// The model with every linear layer's weight stored as int8 codes would store it, back in f32:
/// what an int8 decoder computes exactly, up to f32 summation order.
fn int8_rounded_model(cfg: &ModelConfig, seed: u64) -> Model {
    let round = |t: &Tensor| {
        let rows = t.to_vec2::<f32>().unwrap();
        let deq: Vec<Vec<f32>> = rows
            .iter()
            .map(|row| {
                let s = int8_scale(row);
                row.iter().map(|&v| int8_code(v, s) as f32 * s).collect()
            })
            .collect();
        Tensor::new(deq, &Device::Cpu).unwrap()
    };
    let w: HashMap<String, Tensor> = init_weights(cfg, seed, DType::F32, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let linear = n.ends_with("_proj.weight") || n == "lm_head.weight";
            let t = if linear { round(&t) } else { t };
            (n, t)
        })
        .collect();
    Model::from_weights(cfg, &w).unwrap()
}

#[test]
fn int8_weights_compute_the_rounded_model() {
    // Tied heads are left out: there the embedding lookup stays f32 while the head is rounded,
    // which no single rounded model reproduces.
    for (name, cfg) in configs().into_iter().filter(|(_, c)| !c.tie_embeddings) {
        check_int8(&format!("{name} int8"), &cfg);
    }
}

/// bf16 weights multiply inputs rounded to bf16 with f32 sums: the full forward whose linear
/// layers run bf16 products (`Precision::Bf16Emulated`, rounded copies through f32 gemm) and whose
/// attention stays f32 (the reference kernels), at every position.
#[test]
fn bf16_weights_compute_the_model_with_bf16_products() {
    for (name, cfg) in configs() {
        let mut m = model(&cfg, 4);
        let ids = tokens(cfg.max_seq_len, cfg.vocab_size, 3);
        let exact = Decoder::new(&m).unwrap();
        let dec = Decoder::with_precision(&m, WeightPrecision::Bf16).unwrap();
        m.opts = RunOptions { kernels: Kernels::Reference, precision: Precision::Bf16Emulated, ..Default::default() };
        let full = m.forward(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(), None).unwrap();
        let full = full.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
        let scale = full.iter().flatten().fold(1.0f32, |a, v| a.max(v.abs()));
        let (mut seq, mut f32_seq) = (dec.new_sequence(), exact.new_sequence());
        let mut logits = dec.prefill(&mut seq, &ids[..5]).unwrap();
        let mut f32_logits = exact.prefill(&mut f32_seq, &ids[..5]).unwrap();
        // Per position, the largest |difference| over `scale`: from the reference, from f32.
        let (mut off, mut moved) = (Vec::new(), Vec::new());
        for t in 4..cfg.max_seq_len {
            if t > 4 {
                logits = dec.step(&mut [&mut seq], &[ids[t]]).unwrap();
                f32_logits = exact.step(&mut [&mut f32_seq], &[ids[t]]).unwrap();
            }
            off.push(max_abs(&logits, &full[t]) / scale);
            moved.push(max_abs(&logits, &f32_logits) / scale);
        }
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
        let worst = |v: &[f32]| v.iter().cloned().fold(0.0, f32::max);
        // Measured (these deliberately sharp models): off 2e-7-2.7e-4 on average and 2e-5-8.4e-3
        // at worst (an input whose f32 value differs in the last bits between the two paths can
        // round to the neighbouring bf16 value), moved from f32 8.7e-3-1.6e-2 on average.
        let (off_mean, moved_mean) = (mean(&off), mean(&moved));
        assert!(moved_mean > 0.0, "{name}: bf16 weights changed nothing: are the products rounded at all?");
        assert!(
            off_mean < 1e-3 && worst(&off) < 2e-2,
            "{name}: {off_mean} from bf16 products on average, {} at worst",
            worst(&off)
        );
        assert!(off_mean < 0.1 * moved_mean, "{name}: {off_mean} from bf16 products, {moved_mean} from f32");
    }
}

/// An int8 decoder against the f32 decoder of the model rounded as it rounds, step by step.
fn check_int8(name: &str, cfg: &ModelConfig) {
    let m = model(cfg, 4);
    let rounded_weights = int8_rounded_model(cfg, 4);
    let decoder = Decoder::with_precision(&m, WeightPrecision::Int8).unwrap();
    let (exact, reference) = (Decoder::new(&m).unwrap(), Decoder::new(&rounded_weights).unwrap());
    let ids = tokens(20, cfg.vocab_size, 9);
    // Both start from the prompt's cache of the int8 decoder (the reference's
    // weights are the same numbers): the steps are what is compared.
    let mut a = decoder.new_sequence();
    decoder.prefill(&mut a, &ids[..3]).unwrap();
    let mut b = a.clone();
    let mut c = exact.new_sequence();
    exact.prefill(&mut c, &ids[..3]).unwrap();
    for &t in &ids[3..] {
        let la = decoder.step(&mut [&mut a], &[t]).unwrap();
        let lb = reference.step(&mut [&mut b], &[t]).unwrap();
        let lc = exact.step(&mut [&mut c], &[t]).unwrap();
        let scale = lb.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let err = max_abs(&la, &lb);
        assert!(err <= 1e-4 * scale, "{name}: decoder vs the rounded model: {err} (scale {scale})");
        assert!(max_abs(&la, &lc) > 0.0, "{name}: rounding changed nothing: are the weights rounded at all?");
    }
}

#[test]
fn extend_returns_what_single_steps_return_and_truncate_rewinds() {
    for (name, cfg) in configs() {
        let m = model(&cfg, 13);
        let dec = Decoder::new(&m).unwrap();
        // Rows of one pass that cross from the cache's first chunk into its second.
        let (prompt, more) = (tokens(60, cfg.vocab_size, 9), tokens(7, cfg.vocab_size, 10));
        let mut stepped = dec.new_sequence();
        dec.prefill(&mut stepped, &prompt).unwrap();
        let single: Vec<f32> = more.iter().flat_map(|&t| dec.step(&mut [&mut stepped], &[t]).unwrap()).collect();
        let mut seq = dec.new_sequence();
        dec.prefill(&mut seq, &prompt).unwrap();
        let rows = dec.extend(&mut seq, &more).unwrap();
        assert_eq!(seq.len(), stepped.len(), "{name}");
        assert!(max_abs(&rows, &single) < 1e-5, "{name}: extend against steps");
        // Back to 62 positions, then other tokens: as if the last five had never been there.
        seq.truncate(62);
        assert_eq!(seq.len(), 62, "{name}");
        let other = tokens(4, cfg.vocab_size, 11);
        let after = dec.extend(&mut seq, &other).unwrap();
        let mut fresh = dec.new_sequence();
        dec.prefill(&mut fresh, &[&prompt[..], &more[..2]].concat()).unwrap();
        let expected = dec.extend(&mut fresh, &other).unwrap();
        assert!(max_abs(&after, &expected) < 1e-5, "{name}: after truncate");
        // `append` gives the logits after the last of its tokens.
        let mut appended = dec.new_sequence();
        dec.prefill(&mut appended, &[&prompt[..], &more[..2]].concat()).unwrap();
        let last = dec.append(&mut appended, &other).unwrap();
        assert_eq!((appended.len(), last.len()), (66, cfg.vocab_size), "{name}");
        assert!(max_abs(&last, &expected[3 * cfg.vocab_size..]) < 1e-5, "{name}: append");
        // Truncating past the end changes nothing; extending past the context is an error.
        seq.truncate(1000);
        assert_eq!(seq.len(), 66, "{name}");
        let err = dec.extend(&mut seq, &tokens(cfg.max_seq_len, cfg.vocab_size, 1)).unwrap_err().to_string();
        assert!(err.contains("context"), "{name}: {err}");
    }
}

/// Greedy and two sampled settings: what the speculative tests run.
fn sampling_settings() -> Vec<SamplingParams> {
    vec![
        SamplingParams { temperature: 0.0, ..Default::default() },
        SamplingParams { temperature: 0.9, top_k: Some(20), top_p: None, seed: 7 },
        SamplingParams { temperature: 1.3, top_k: None, top_p: Some(0.9), seed: 8 },
    ]
}

fn sampler(params: &SamplingParams) -> Sampler {
    Sampler::new(params.clone()).unwrap()
}

#[test]
fn speculative_decoding_gives_the_target_tokens_whatever_the_draft() {
    for (name, cfg) in configs() {
        let m = model(&cfg, 3);
        let target = Decoder::new(&m).unwrap();
        // The same model with bf16 weights and cache (mostly right), another model (mostly
        // wrong), the target itself (always right), a draft whose context is shorter.
        let bf16 = bf16_draft(&m).unwrap();
        let other = Decoder::new(&model(&cfg, 4)).unwrap();
        let same = Decoder::new(&m).unwrap();
        let mut short_cfg = cfg.clone();
        short_cfg.max_seq_len = 20;
        let short = Decoder::new(&model(&short_cfg, 3)).unwrap();
        let prompt = tokens(4, cfg.vocab_size, 8);
        for (params, max_new) in sampling_settings().iter().flat_map(|p| [(p, cfg.max_seq_len), (p, 7), (p, 1)]) {
            let plain = generate_fused(&target, &prompt, max_new, &mut sampler(params), |_| Ok(())).unwrap();
            if params.temperature > 0.0 && max_new == cfg.max_seq_len {
                let greedy_text = generate_fused(&target, &prompt, max_new, &mut greedy(), |_| Ok(())).unwrap();
                assert_ne!(plain, greedy_text, "{name}: sampling at {} gave the greedy text", params.temperature);
            }
            for (draft_name, draft) in [("bf16", &bf16), ("other", &other), ("same", &same), ("short", &short)] {
                for draft_len in [1, 3, 5] {
                    let case = format!(
                        "{name}, {draft_name} draft, {draft_len} drafts, {max_new} new, temperature {}",
                        params.temperature
                    );
                    let mut streamed = Vec::new();
                    let (out, stats) =
                        generate_speculative(&target, draft, &prompt, max_new, draft_len, &mut sampler(params), |t| {
                            streamed.push(t);
                            Ok(())
                        })
                        .unwrap();
                    assert_eq!(out, plain, "{case}");
                    assert_eq!(streamed, plain, "{case}: tokens as they come");
                    assert!(stats.accepted <= stats.drafted, "{case}: {stats:?}");
                    if draft_name == "same" {
                        assert_eq!(stats.accepted, stats.drafted, "{case}: the target's own drafts");
                    }
                    if max_new == cfg.max_seq_len && draft_name != "short" {
                        // A pass yields its kept drafts and one token more.
                        assert_eq!(stats.rounds + stats.accepted, plain.len() - 1, "{case}: {stats:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn speculative_passes_between_batched_steps_give_the_tokens_of_single_steps() {
    // The server's use: a request decoded by passes while it runs alone and by single steps while
    // it shares the batch (the draft told of each such token), its draft started mid-sequence.
    for ((name, cfg), params) in
        configs().into_iter().flat_map(|c| sampling_settings().into_iter().map(move |p| (c.clone(), p)))
    {
        let name = format!("{name}, temperature {}", params.temperature);
        let m = model(&cfg, 5);
        let target = Decoder::new(&m).unwrap();
        let draft = bf16_draft(&m).unwrap();
        let prompt = tokens(6, cfg.vocab_size, 12);
        let max_new = cfg.max_seq_len - prompt.len();
        let plain = generate_fused(&target, &prompt, max_new, &mut sampler(&params), |_| Ok(())).unwrap();
        let mut s = sampler(&params);
        let mut seq = target.new_sequence();
        let mut out = vec![s.sample(&target.prefill(&mut seq, &prompt).unwrap())];
        let mut drafter: Option<SpeculativeDraft> = None;
        let (mut round, mut passes) = (0, 0);
        while out.len() < max_new {
            let next = *out.last().unwrap();
            if round % 3 == 0 {
                let logits = target.step(&mut [&mut seq], &[next]).unwrap();
                if let Some(d) = drafter.as_mut() {
                    d.push(next);
                }
                out.push(s.sample(&logits));
            } else {
                let history = [&prompt[..], &out[..out.len() - 1]].concat();
                assert_eq!(history.len(), seq.len(), "{name}");
                let d = drafter.get_or_insert_with(|| SpeculativeDraft::new(&target, &draft, &history).unwrap());
                let pass = d.pass(&target, &draft, &mut seq, next, 3, max_new - out.len(), &mut s).unwrap();
                assert!(!pass.tokens.is_empty() && pass.tokens.len() <= 4, "{name}: {pass:?}");
                assert_eq!(pass.tokens.len(), pass.accepted + 1, "{name}: {pass:?}");
                out.extend(pass.tokens);
                passes += 1;
            }
            round += 1;
        }
        assert!(passes > 3, "{name}: {passes} passes");
        assert_eq!(out, plain, "{name}");
        // The last position: no room for drafts, the target's token alone. A pass with no token
        // to give, or no room for one, is refused.
        let mut d = drafter.unwrap();
        let err = d.pass(&target, &draft, &mut seq, 0, 3, 0, &mut s).unwrap_err().to_string();
        assert!(err.contains("room"), "{name}: {err}");
        let pass = d.pass(&target, &draft, &mut seq, *out.last().unwrap(), 3, 5, &mut s).unwrap();
        assert_eq!((pass.drafted, pass.tokens.len(), seq.len()), (0, 1, cfg.max_seq_len), "{name}");
        let err = d.pass(&target, &draft, &mut seq, pass.tokens[0], 3, 5, &mut s).unwrap_err().to_string();
        assert!(err.contains("room"), "{name}: {err}");
    }
}

#[test]
fn speculative_decoding_refuses_a_draft_it_cannot_use() {
    let (_, cfg) = configs().remove(0);
    let target = Decoder::new(&model(&cfg, 1)).unwrap();
    let mut small = cfg.clone();
    small.vocab_size = 60;
    let draft = Decoder::new(&model(&small, 1)).unwrap();
    let err = generate_speculative(&target, &draft, &[1, 2], 5, 3, &mut greedy(), |_| Ok(())).unwrap_err().to_string();
    assert!(err.contains("vocabulary"), "{err}");
    let err = generate_speculative(&target, &target, &[1, 2], 5, 0, &mut greedy(), |_| Ok(())).unwrap_err().to_string();
    assert!(err.contains("at least 1"), "{err}");
}
