//! The model against a slow, independent reference: plain f64 loops written from the maths of
//! docs/design.md §1–4 (not from the model code), on random weights and awkward shapes; KV-cache equivalence;
//! gradients of every parameter against central finite differences.

// The reference indexes heads and positions the way the equations do.
#![allow(clippy::needless_range_loop)]

use candle_core::{DType, Device, Tensor, Var};
use difftx_core::config::{Family, HeadPairing, ModelConfig, RopeStyle};
use difftx_core::model::{init_weights, param_specs, KvCache, Model};
use std::collections::HashMap;

// ---------------------------------------------------------------- the f64 reference model

struct RefModel {
    cfg: ModelConfig,
    w: HashMap<String, Vec<f64>>,
}

impl RefModel {
    fn new(cfg: &ModelConfig, weights: &[(String, Tensor)]) -> Self {
        let w = weights
            .iter()
            .map(|(n, t)| (n.clone(), t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()))
            .collect();
        RefModel { cfg: cfg.clone(), w }
    }

    fn get(&self, name: &str) -> &[f64] {
        self.w.get(name).unwrap_or_else(|| panic!("reference: missing {name}"))
    }

    /// y[o] = sum_i W[o, i] x[i], W stored row-major [out, in].
    fn linear(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let w = self.get(name);
        let n_in = x.len();
        assert_eq!(w.len() % n_in, 0, "{name}");
        (0..w.len() / n_in).map(|o| (0..n_in).map(|i| w[o * n_in + i] * x[i]).sum()).collect()
    }

    fn rms(x: &[f64], gain: Option<&[f64]>, eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().enumerate().map(|(i, v)| v * r * gain.map_or(1.0, |g| g[i])).collect()
    }

    fn rope(&self, x: &mut [f64], pos: usize) {
        let d = x.len();
        for i in 0..d / 2 {
            let angle = pos as f64 * self.cfg.rope_theta.powf(-(2.0 * i as f64) / d as f64);
            let (c, s) = (angle.cos(), angle.sin());
            let (a, b) = match self.cfg.rope_style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::RotateHalf => (i, i + d / 2),
            };
            let (x0, x1) = (x[a], x[b]);
            x[a] = x0 * c - x1 * s;
            x[b] = x0 * s + x1 * c;
        }
    }

    /// Causal softmax attention of one query over keys 0..=t; returns the weighted values.
    fn attend(q: &[f64], keys: &[Vec<f64>], values: &[Vec<f64>], scale: f64) -> Vec<f64> {
        let scores: Vec<f64> = keys.iter().map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale).collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let z: f64 = e.iter().sum();
        let mut out = vec![0.0; values[0].len()];
        for (p, v) in e.iter().zip(values) {
            for (o, x) in out.iter_mut().zip(v) {
                *o += p / z * x;
            }
        }
        out
    }

    fn pair(&self, j: usize, count: usize) -> (usize, usize) {
        match self.cfg.head_pairing {
            HeadPairing::Interleaved => (2 * j, 2 * j + 1),
            HeadPairing::Halves => (j, j + count / 2),
        }
    }

    fn attention(&self, layer: usize, xs: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let cfg = &self.cfg;
        let p = format!("model.layers.{layer}.self_attn");
        let d = cfg.head_dim();
        let scale = 1.0 / (d as f64).sqrt();
        let split = |v: Vec<f64>| -> Vec<Vec<f64>> { v.chunks(d).map(|c| c.to_vec()).collect() };
        // Per position: heads of dim d.
        let mut q: Vec<Vec<Vec<f64>>> =
            xs.iter().map(|x| split(self.linear(&format!("{p}.q_proj.weight"), x))).collect();
        let mut k: Vec<Vec<Vec<f64>>> =
            xs.iter().map(|x| split(self.linear(&format!("{p}.k_proj.weight"), x))).collect();
        let v: Vec<Vec<Vec<f64>>> = xs.iter().map(|x| split(self.linear(&format!("{p}.v_proj.weight"), x))).collect();
        for (t, heads) in q.iter_mut().enumerate() {
            heads.iter_mut().for_each(|h| self.rope(h, t));
        }
        for (t, heads) in k.iter_mut().enumerate() {
            heads.iter_mut().for_each(|h| self.rope(h, t));
        }
        let n_q = q[0].len();
        let n_kv = k[0].len();
        let keys = |g: usize, t: usize| -> Vec<Vec<f64>> { (0..=t).map(|u| k[u][g].clone()).collect() };
        let vals = |g: usize, t: usize| -> Vec<Vec<f64>> { (0..=t).map(|u| v[u][g].clone()).collect() };
        let mut out = Vec::new();
        for t in 0..xs.len() {
            let mut o_t = Vec::new();
            match cfg.family {
                Family::Baseline => {
                    for i in 0..n_q {
                        let g = i / (n_q / n_kv);
                        o_t.extend(Self::attend(&q[t][i], &keys(g, t), &vals(g, t), scale));
                    }
                }
                Family::DiffV1 => {
                    let dot = |a: &str, b: &str| -> f64 {
                        self.get(&format!("{p}.{a}"))
                            .iter()
                            .zip(self.get(&format!("{p}.{b}")))
                            .map(|(x, y)| x * y)
                            .sum()
                    };
                    let lambda_init = 0.8 - 0.6 * (-0.3 * layer as f64).exp();
                    let lambda =
                        dot("lambda_q1", "lambda_k1").exp() - dot("lambda_q2", "lambda_k2").exp() + lambda_init;
                    let n_rep = n_q / n_kv;
                    for j in 0..n_q / 2 {
                        let (qa, qb) = self.pair(j, n_q);
                        let g = j / n_rep;
                        let (ka, kb) = self.pair(g, n_kv);
                        // value of head j: [v_ka | v_kb], width 2d
                        let value: Vec<Vec<f64>> =
                            (0..=t).map(|u| v[u][ka].iter().chain(&v[u][kb]).cloned().collect()).collect();
                        let o1 = Self::attend(&q[t][qa], &keys(ka, t), &value, scale);
                        let o2 = Self::attend(&q[t][qb], &keys(kb, t), &value, scale);
                        let o: Vec<f64> = o1.iter().zip(&o2).map(|(a, b)| a - lambda * b).collect();
                        // Sub-layer norm (unless the "without GroupNorm" ablation), then (1 - lambda_init).
                        let o = if cfg.subln {
                            let gain = cfg.subln_affine.then(|| self.get(&format!("{p}.subln.weight")));
                            Self::rms(&o, gain, cfg.subln_eps)
                        } else {
                            o
                        };
                        o_t.extend(o.iter().map(|x| x * (1.0 - lambda_init)));
                    }
                }
                Family::DiffV2 => {
                    let lam = self.linear(&format!("{p}.lambda_proj.weight"), &xs[t]);
                    for j in 0..n_q / 2 {
                        let per_kv = n_q / n_kv;
                        let (ia, ib) = (2 * j, 2 * j + 1);
                        let oa = Self::attend(&q[t][ia], &keys(ia / per_kv, t), &vals(ia / per_kv, t), scale);
                        let ob = Self::attend(&q[t][ib], &keys(ib / per_kv, t), &vals(ib / per_kv, t), scale);
                        let l = 1.0 / (1.0 + (-lam[j]).exp());
                        o_t.extend(oa.iter().zip(&ob).map(|(a, b)| a - l * b));
                    }
                }
            }
            out.push(self.linear(&format!("{p}.o_proj.weight"), &o_t));
        }
        out
    }

    fn logits(&self, ids: &[u32]) -> Vec<Vec<f64>> {
        let cfg = &self.cfg;
        let dm = cfg.d_model;
        let emb = self.get("model.embed_tokens.weight");
        let mut xs: Vec<Vec<f64>> = ids.iter().map(|&i| emb[i as usize * dm..(i as usize + 1) * dm].to_vec()).collect();
        for l in 0..cfg.n_layers {
            let p = format!("model.layers.{l}");
            let h: Vec<Vec<f64>> = xs
                .iter()
                .map(|x| Self::rms(x, Some(self.get(&format!("{p}.input_layernorm.weight"))), cfg.norm_eps))
                .collect();
            let a = self.attention(l, &h);
            for (x, a) in xs.iter_mut().zip(&a) {
                x.iter_mut().zip(a).for_each(|(x, a)| *x += a);
            }
            for x in xs.iter_mut() {
                let h = Self::rms(x, Some(self.get(&format!("{p}.post_attention_layernorm.weight"))), cfg.norm_eps);
                let g = self.linear(&format!("{p}.mlp.gate_proj.weight"), &h);
                let u = self.linear(&format!("{p}.mlp.up_proj.weight"), &h);
                let m: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let y = self.linear(&format!("{p}.mlp.down_proj.weight"), &m);
                x.iter_mut().zip(&y).for_each(|(x, y)| *x += y);
            }
        }
        let head = if cfg.tie_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
        xs.iter().map(|x| self.linear(head, &Self::rms(x, Some(self.get("model.norm.weight")), cfg.norm_eps))).collect()
    }
}

// ---------------------------------------------------------------- helpers

fn small_config(family: Family) -> ModelConfig {
    let mut c = ModelConfig::preset("tiny", family).unwrap();
    c.vocab_size = 37;
    c.d_model = 48;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 4;
    c.d_ff = 40;
    c.max_seq_len = 32;
    c.init_std = 0.3; // large enough that attention is far from uniform
    c.lambda_std = 0.3;
    c
}

/// Configs that exercise every switch: GQA, both pairings and RoPE styles, gain off, tied head.
fn variants() -> Vec<(&'static str, ModelConfig)> {
    let mut out = Vec::new();
    for family in Family::ALL {
        out.push(("plain", small_config(family)));
        let mut c = small_config(family);
        c.n_heads = 8;
        c.d_model = 64;
        c.n_kv_heads = 4;
        c.head_pairing = HeadPairing::Halves;
        c.rope_style = RopeStyle::RotateHalf;
        c.subln_affine = false;
        c.tie_embeddings = true;
        c.rope_theta = 500.0;
        out.push(("gqa-halves-rotatehalf-tied", c));
        let mut c = small_config(family);
        c.n_kv_heads = 2;
        c.n_heads = 4;
        c.head_dim = Some(10);
        out.push(("gqa-interleaved-headdim10", c));
    }
    // diff-v1 without the sub-layer norm (the paper's "DIFF without GroupNorm"), with and without GQA.
    let mut c = small_config(Family::DiffV1);
    c.subln = false;
    out.push(("no-subln", c));
    let mut c = small_config(Family::DiffV1);
    c.subln = false;
    c.subln_affine = false;
    c.n_kv_heads = 2;
    c.head_pairing = HeadPairing::Halves;
    out.push(("no-subln-gqa-halves", c));
    out
}

fn perturb_ones(weights: &mut [(String, Tensor)], seed: u64) {
    // Norm gains start at exactly 1; make them random so a transposed gain would be caught.
    let mut s = seed;
    for (name, t) in weights.iter_mut() {
        if name.contains("norm") || name.contains("subln") {
            let n = t.elem_count();
            let v: Vec<f64> = (0..n)
                .map(|_| {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    0.5 + (s >> 11) as f64 / (1u64 << 53) as f64
                })
                .collect();
            *t = Tensor::from_vec(v, t.dims(), t.device()).unwrap().to_dtype(t.dtype()).unwrap();
        }
    }
}

fn ids_for(cfg: &ModelConfig, n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + seed * 13 + i * i) % cfg.vocab_size as u32).collect()
}

fn model_logits(model: &Model, ids: &[Vec<u32>]) -> Vec<Vec<Vec<f64>>> {
    let t = Tensor::new(ids.to_vec(), &Device::Cpu).unwrap();
    let logits = model.forward(&t, None).unwrap();
    logits.to_dtype(DType::F64).unwrap().to_vec3::<f64>().unwrap()
}

fn max_abs_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// A model over fresh `Var`s (so that gradients reach every parameter), and the vars by name.
fn trainable_model(cfg: &ModelConfig, seed: u64) -> (Model, Vec<(String, Var)>) {
    let weights = init_weights(cfg, seed, DType::F32, &Device::Cpu).unwrap();
    let vars: Vec<(String, Var)> = weights.iter().map(|(n, t)| (n.clone(), Var::from_tensor(t).unwrap())).collect();
    let map: HashMap<String, Tensor> = vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    (Model::from_weights(cfg, &map).unwrap(), vars)
}

/// Two sequences of 19 ids and their targets.
fn loss_batch(cfg: &ModelConfig) -> (Tensor, Tensor) {
    let ids = Tensor::new(vec![ids_for(cfg, 19, 1), ids_for(cfg, 19, 8)], &Device::Cpu).unwrap();
    let targets = Tensor::new(vec![ids_for(cfg, 19, 2), ids_for(cfg, 19, 3)], &Device::Cpu).unwrap();
    (ids, targets)
}

/// The logits and every var's gradient of the mean loss, flattened.
fn logits_and_grads(
    model: &Model,
    vars: &[(String, Var)],
    ids: &Tensor,
    targets: &Tensor,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let logits = model.forward(ids, None).unwrap();
    let grads = Model::loss(&logits, targets).unwrap().backward().unwrap();
    let g = vars
        .iter()
        .map(|(_, v)| grads.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    (logits.flatten_all().unwrap().to_vec1::<f32>().unwrap(), g)
}

// ---------------------------------------------------------------- tests

#[test]
fn forward_matches_f64_reference_for_every_family_and_layout() {
    for (label, cfg) in variants() {
        cfg.validate().unwrap();
        let mut weights = init_weights(&cfg, 7, DType::F64, &Device::Cpu).unwrap();
        perturb_ones(&mut weights, 3);
        let reference = RefModel::new(&cfg, &weights);
        let batch = vec![ids_for(&cfg, 13, 1), ids_for(&cfg, 13, 2)]; // odd length, batch 2
        let want: Vec<Vec<Vec<f64>>> = batch.iter().map(|ids| reference.logits(ids)).collect();
        for dtype in [DType::F64, DType::F32] {
            let map: HashMap<_, _> = weights.iter().map(|(n, t)| (n.clone(), t.to_dtype(dtype).unwrap())).collect();
            let model = Model::from_weights(&cfg, &map).unwrap();
            let got = model_logits(&model, &batch);
            let tol = if dtype == DType::F64 { 1e-9 } else { 2e-4 };
            for (g, w) in got.iter().zip(&want) {
                let err = max_abs_diff(g, w);
                assert!(err < tol, "{} {label} {dtype:?}: max |diff| {err}", cfg.family);
            }
        }
    }
}

#[test]
fn kv_cache_decoding_equals_full_forward() {
    for (label, cfg) in variants() {
        let weights = init_weights(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
        let map: HashMap<_, _> = weights.into_iter().collect();
        let model = Model::from_weights(&cfg, &map).unwrap();
        let ids = ids_for(&cfg, 11, 5);
        let full = model_logits(&model, std::slice::from_ref(&ids)).remove(0);
        let mut cache = KvCache::new(&cfg);
        let mut got = Vec::new();
        // A prompt of 4 tokens, then one token at a time.
        for chunk in [&ids[..4], &ids[4..5], &ids[5..6], &ids[6..9], &ids[9..10], &ids[10..]] {
            let t = Tensor::new(chunk, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let l = model.forward(&t, Some(&mut cache)).unwrap();
            got.extend(l.squeeze(0).unwrap().to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap());
        }
        assert_eq!(cache.seq_len(), ids.len());
        let err = max_abs_diff(&got, &full);
        assert!(err < 1e-4, "{} {label}: cached vs full max |diff| {err}", cfg.family);
    }
}

#[test]
fn prompt_longer_than_context_is_an_error() {
    let cfg = small_config(Family::DiffV1);
    let map: HashMap<_, _> = init_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap().into_iter().collect();
    let model = Model::from_weights(&cfg, &map).unwrap();
    let ids = Tensor::zeros((1, cfg.max_seq_len + 1), DType::U32, &Device::Cpu).unwrap();
    let err = model.forward(&ids, None).unwrap_err().to_string();
    assert!(err.contains("longer than the model's context"), "{err}");
}

#[test]
fn wrong_shapes_and_missing_weights_are_named() {
    let cfg = small_config(Family::DiffV1);
    let mut map: HashMap<_, _> = init_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap().into_iter().collect();
    map.remove("model.layers.1.self_attn.lambda_k2");
    let err = Model::from_weights(&cfg, &map).err().unwrap().to_string();
    assert!(err.contains("model.layers.1.self_attn.lambda_k2"), "{err}");
    let base = small_config(Family::Baseline);
    let map: HashMap<_, _> = init_weights(&base, 1, DType::F32, &Device::Cpu).unwrap().into_iter().collect();
    let mut other = base.clone();
    other.d_ff = 64;
    let err = Model::from_weights(&other, &map).err().unwrap().to_string();
    assert!(err.contains("mlp.gate_proj.weight") && err.contains("shape"), "{err}");
}

#[test]
fn param_counts_match_built_tensors() {
    for (label, cfg) in variants() {
        let specs = param_specs(&cfg);
        let n: usize = specs.iter().map(|s| s.shape.iter().product::<usize>()).sum();
        assert_eq!(n, cfg.param_counts().total, "{} {label}", cfg.family);
    }
}

/// Loss of a tiny model in f64, as a function of its Vars.
fn loss_of(cfg: &ModelConfig, vars: &[(String, Var)], ids: &Tensor, targets: &Tensor) -> Tensor {
    let map: HashMap<String, Tensor> = vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    let model = Model::from_weights(cfg, &map).unwrap();
    Model::loss(&model.forward(ids, None).unwrap(), targets).unwrap()
}

#[test]
fn gradients_of_every_parameter_match_finite_differences() {
    let cases = Family::ALL.iter().map(|&f| (f, true)).chain([(Family::DiffV1, false)]);
    for (family, subln) in cases {
        let mut cfg = small_config(family);
        cfg.subln = subln;
        cfg.d_model = 16;
        cfg.n_heads = 4;
        cfg.n_kv_heads = 2;
        cfg.d_ff = 12;
        cfg.vocab_size = 11;
        cfg.init_std = 0.5;
        let mut weights = init_weights(&cfg, 5, DType::F64, &Device::Cpu).unwrap();
        perturb_ones(&mut weights, 9);
        let vars: Vec<(String, Var)> = weights.iter().map(|(n, t)| (n.clone(), Var::from_tensor(t).unwrap())).collect();
        let ids = Tensor::new(&[[1u32, 4, 2, 9, 3, 3, 7], [0, 10, 5, 6, 1, 8, 2]], &Device::Cpu).unwrap();
        let targets = Tensor::new(&[[4u32, 2, 9, 3, 3, 7, 1], [10, 5, 6, 1, 8, 2, 0]], &Device::Cpu).unwrap();
        let loss = loss_of(&cfg, &vars, &ids, &targets);
        let grads = loss.backward().unwrap();
        let eps = 1e-5;
        for (name, var) in &vars {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{family}: no gradient reached {name}"))
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let base = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            // Check a spread of entries of every parameter.
            let picks: Vec<usize> = (0..base.len()).step_by((base.len() / 3).max(1)).take(3).collect();
            for &i in &picks {
                let mut plus = base.clone();
                plus[i] += eps;
                var.set(&Tensor::from_vec(plus, var.as_tensor().dims(), &Device::Cpu).unwrap()).unwrap();
                let lp = loss_of(&cfg, &vars, &ids, &targets).to_scalar::<f64>().unwrap();
                let mut minus = base.clone();
                minus[i] -= eps;
                var.set(&Tensor::from_vec(minus, var.as_tensor().dims(), &Device::Cpu).unwrap()).unwrap();
                let lm = loss_of(&cfg, &vars, &ids, &targets).to_scalar::<f64>().unwrap();
                var.set(&Tensor::from_vec(base.clone(), var.as_tensor().dims(), &Device::Cpu).unwrap()).unwrap();
                let fd = (lp - lm) / (2.0 * eps);
                let err = (fd - g[i]).abs();
                assert!(err < 1e-6 + 1e-4 * fd.abs(), "{family} {name}[{i}]: analytic {} vs numeric {fd}", g[i]);
            }
            if name.contains("lambda") {
                assert!(
                    g.iter().any(|x| x.abs() > 1e-8),
                    "{family}: gradient of {name} is zero: lambda is not learned"
                );
            }
        }
    }
}

#[test]
fn quantisation_probes_change_logits_by_the_expected_amount() {
    for family in Family::ALL {
        let cfg = small_config(family);
        let map: HashMap<_, _> = init_weights(&cfg, 3, DType::F32, &Device::Cpu).unwrap().into_iter().collect();
        let mut model = Model::from_weights(&cfg, &map).unwrap();
        let ids = vec![ids_for(&cfg, 9, 4)];
        let exact = model_logits(&model, &ids).remove(0);
        let mut errs = Vec::new();
        for (attn, act) in [(Some(16), None), (Some(4), None), (None, Some(16)), (None, Some(4))] {
            model.opts.attn_logit_bits = attn;
            model.opts.act_bits = act;
            errs.push(max_abs_diff(&model_logits(&model, &ids).remove(0), &exact));
        }
        // 16 bits is close to exact; 4 bits is visibly worse, for logits and for activations.
        assert!(errs[0] < 1e-3 && errs[2] < 1e-2, "{family}: {errs:?}");
        assert!(errs[1] > 10.0 * errs[0] && errs[3] > 10.0 * errs[2], "{family}: {errs:?}");
    }
}

#[test]
fn fused_kernels_equal_reference_path_forward_and_backward() {
    use difftx_core::Kernels;
    for (label, cfg) in variants() {
        let (mut model, vars) = trainable_model(&cfg, 21);
        let (ids, targets) = loss_batch(&cfg);
        let mut results = Vec::new();
        for kernels in [Kernels::Reference, Kernels::Fused] {
            model.opts.kernels = kernels;
            results.push(logits_and_grads(&model, &vars, &ids, &targets));
        }
        let (r, f) = (&results[0], &results[1]);
        let rel = |a: &[f32], b: &[f32]| {
            let scale = a.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-6);
            a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max) / scale
        };
        assert!(rel(&r.0, &f.0) < 1e-5, "{} {label}: logits differ by {}", cfg.family, rel(&r.0, &f.0));
        for ((name, _), (gr, gf)) in vars.iter().zip(r.1.iter().zip(&f.1)) {
            let e = rel(gr, gf);
            assert!(e < 1e-4, "{} {label}: gradient of {name} differs by {e} (relative to its max)", cfg.family);
        }
    }
}

#[test]
fn quantized_weights_stay_close_to_f32() {
    use difftx_core::WeightFormat;
    let mut cfg = small_config(Family::DiffV1);
    cfg.d_model = 256;
    cfg.d_ff = 512;
    cfg.n_heads = 8;
    cfg.n_kv_heads = 8;
    cfg.init_std = 0.05;
    let map: HashMap<_, _> = init_weights(&cfg, 4, DType::F32, &Device::Cpu).unwrap().into_iter().collect();
    let ids = vec![ids_for(&cfg, 12, 3)];
    let exact = model_logits(&Model::from_weights(&cfg, &map).unwrap(), &ids).remove(0);
    let spread = exact.iter().flatten().map(|x| x.abs()).fold(0.0, f64::max);
    let mut errs = Vec::new();
    for (format, want_type) in [(WeightFormat::Q8_0, "Q8_0"), (WeightFormat::Q4K, "Q4K")] {
        let mut model = Model::from_weights(&cfg, &map).unwrap();
        let used = model.quantize_weights(format).unwrap();
        assert!(used.contains_key(want_type), "{used:?}");
        let got = model_logits(&model, &ids).remove(0);
        errs.push(max_abs_diff(&got, &exact) / spread);
        // Cached decoding agrees with the full pass on the quantised model. Not bit-exact: candle's
        // quantised matmul takes a different path (activations quantised per block) for a
        // single row than for many rows, so allow the quantisation noise of this format.
        let mut cache = KvCache::new(&cfg);
        let t = Tensor::new(&ids[0][..6], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        model.forward(&t, Some(&mut cache)).unwrap();
        let t = Tensor::new(&ids[0][6..7], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let step = model
            .forward(&t, Some(&mut cache))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let d = step.iter().zip(&got[6]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let noise = max_abs_diff(&got, &exact);
        assert!(
            d <= 2.0 * noise,
            "{format:?}: cached step differs by {d} (quantisation error {noise}, spread {spread})"
        );
    }
    // 8-bit is close; 4-bit is further off but still the same function.
    // (A wrong layout or scale gives errors of order 1.)
    assert!(errs[0] < 0.06 && errs[1] < 0.6 && errs[1] > errs[0], "relative errors {errs:?}");
}

#[test]
fn bf16_products_match_their_emulation_and_stay_near_f32() {
    use difftx_core::Precision;
    // f32; bf16 emulated by f32 gemm on rounded copies (any CPU); bf16 on the AMX /
    // AVX512_BF16 kernel where the CPU has one (even where `--precision bf16` would run f32
    // because the kernel is slower than f32 there).
    let mut runs = vec![Precision::F32, Precision::Bf16Emulated];
    if difftx_kernels::bf16_backend().is_some() {
        runs.push(Precision::Bf16);
    } else {
        eprintln!("this CPU has neither AMX-BF16 nor AVX512_BF16: only the emulated bf16 path is checked");
    }
    for (label, mut cfg) in variants() {
        // The variants' large initialisation (std 0.3) makes attention nearly one-hot, so an
        // input that rounds to the other bf16 neighbour (the sums' order differs between kernel
        // and emulation) can move a whole attention row; at a trained model's scale it cannot.
        cfg.init_std = 0.05;
        let (mut model, vars) = trainable_model(&cfg, 5);
        let (ids, targets) = loss_batch(&cfg);
        let mut results = Vec::new();
        for &precision in &runs {
            model.opts.precision = precision;
            results.push(logits_and_grads(&model, &vars, &ids, &targets));
        }
        // Largest difference relative to the largest value.
        let rel = |a: &[f32], b: &[f32]| {
            let scale = a.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-6);
            a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max) / scale
        };
        let (f32_run, emulated) = (&results[0], &results[1]);
        // bf16 keeps 8 significant bits: logits move by well under 1% of their largest value
        // here, weight gradients by a few percent. The λ vectors' gradients are sums that nearly
        // cancel, so their relative error says little; the comparison with the emulation covers them.
        let e = rel(&f32_run.0, &emulated.0);
        assert!(e < 2e-2 && e > 1e-5, "{} {label}: bf16 logits differ from f32 by {e}", cfg.family);
        for ((name, _), (a, b)) in vars.iter().zip(f32_run.1.iter().zip(&emulated.1)) {
            let e = rel(a, b);
            assert!(
                name.contains("lambda") || e < 5e-2,
                "{} {label}: bf16 gradient of {name} differs from f32 by {e}",
                cfg.family
            );
        }
        if let Some(kernel) = results.get(2) {
            // Same roundings; only the order of the f32 sums differs (AVX512_BF16 matches gemm's
            // to ~1e-7). A sum that lands one f32 ulp away can round a later layer's input to
            // the other bf16 neighbour, which moves that token's row by ~1e-4 downstream: hence
            // a bound well above f32 rounding but far below any layout or indexing error.
            let e = rel(&emulated.0, &kernel.0);
            assert!(e < 3e-3, "{} {label}: bf16 kernel logits differ from the emulation by {e}", cfg.family);
            for ((name, _), (a, b)) in vars.iter().zip(emulated.1.iter().zip(&kernel.1)) {
                let e = rel(a, b);
                assert!(
                    e < 1.5e-2,
                    "{} {label}: bf16 kernel gradient of {name} differs from the emulation by {e}",
                    cfg.family
                );
            }
        }
    }
}
