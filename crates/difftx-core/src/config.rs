//! Model configuration: one serde struct for all three attention families.
//!
//! Head counts are always given in *baseline* terms (docs/design.md §2): `n_heads` is the baseline's head
//! count `H`, `n_kv_heads` its key/value head count. Each family derives its own layout from these,
//! so the three families built from one config are parameter-matched.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Which attention the model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// Standard multi-head attention (docs/design.md §1.1).
    Baseline,
    /// Differential attention of the paper (docs/design.md §1.2).
    DiffV1,
    /// Differential attention v2: per-token sigmoid lambda, no sub-layer norm (docs/design.md §1.3).
    DiffV2,
}

impl Family {
    pub const ALL: [Family; 3] = [Family::Baseline, Family::DiffV1, Family::DiffV2];
    pub fn as_str(&self) -> &'static str {
        match self {
            Family::Baseline => "baseline",
            Family::DiffV1 => "diff-v1",
            Family::DiffV2 => "diff-v2",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Family {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "baseline" => Ok(Family::Baseline),
            "diff-v1" | "diff" => Ok(Family::DiffV1),
            "diff-v2" => Ok(Family::DiffV2),
            _ => Err(format!("unknown attention family '{s}' (expected baseline, diff-v1 or diff-v2)")),
        }
    }
}

/// How the two halves of each rotated pair are laid out in a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1): GPT-J / official Diff-Transformer code.
    Interleaved,
    /// Pairs (i, i + d/2): GPT-NeoX / Hugging Face Llama and DiffLlama.
    RotateHalf,
}

/// Which two projected heads form the two maps of differential head `j` (docs/design.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HeadPairing {
    /// Heads 2j and 2j+1 (official code).
    Interleaved,
    /// Heads j and j + count/2 (Hugging Face DiffLlama).
    Halves,
}

impl HeadPairing {
    /// The two indices (among `count` projected heads) that form pair `j`.
    pub fn pair(&self, j: usize, count: usize) -> (usize, usize) {
        match self {
            HeadPairing::Interleaved => (2 * j, 2 * j + 1),
            HeadPairing::Halves => (j, j + count / 2),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    /// Model width D.
    pub d_model: usize,
    pub n_layers: usize,
    /// Baseline head count H; the per-map head dim is `head_dim` (default D / H).
    pub n_heads: usize,
    /// Baseline key/value head count (GQA when < n_heads).
    pub n_kv_heads: usize,
    /// Per-map head dim d. `None` means D / H.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// SwiGLU hidden width.
    pub d_ff: usize,
    pub max_seq_len: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_rope_style")]
    pub rope_style: RopeStyle,
    #[serde(default = "default_pairing")]
    pub head_pairing: HeadPairing,
    /// diff-v1 sub-layer RMSNorm over each head's 2d features (the paper's "GroupNorm"). `false` is
    /// the paper's ablation "DIFF without GroupNorm" (Table 6): no norm and no gain parameter, the
    /// output is still multiplied by (1 - lambda_init). Default true (configs without the field
    /// load as before). Cannot be exported to Hugging Face (DiffLlama always normalises).
    #[serde(default = "default_true")]
    pub subln: bool,
    /// Learnable gain of the diff-v1 sub-layer RMSNorm (official code: true; HF DiffLlama: false).
    /// Ignored when `subln` is false (there is no norm to carry a gain).
    #[serde(default = "default_true")]
    pub subln_affine: bool,
    /// Std of the diff-v1 lambda vectors' normal initialisation.
    #[serde(default = "default_lambda_std")]
    pub lambda_std: f64,
    #[serde(default)]
    pub tie_embeddings: bool,
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Eps of the diff-v1 sub-layer norm.
    #[serde(default = "default_norm_eps")]
    pub subln_eps: f64,
    #[serde(default = "default_init_std")]
    pub init_std: f64,
}

fn default_rope_theta() -> f64 {
    10000.0
}
fn default_rope_style() -> RopeStyle {
    RopeStyle::Interleaved
}
fn default_pairing() -> HeadPairing {
    HeadPairing::Interleaved
}
fn default_true() -> bool {
    true
}
fn default_lambda_std() -> f64 {
    0.1
}
fn default_norm_eps() -> f64 {
    1e-5
}
fn default_init_std() -> f64 {
    0.02
}

/// Weight-initialisation std of the presets at width `d_model`: 1/√D (fan-in scaling), so at
/// initialisation q·k logits and the LM head's logits are of order one at every width. The
/// earlier fixed 0.02 (GPT-2's value at D 768) left attention nearly uniform at D 64-128: q and k
/// started ~0.2 per component, and since the gradient of each is proportional to the other, models
/// sat for millions of tokens on the plateau before copying from context (measured in
/// docs/compare/calibration.md).
pub fn preset_init_std(d_model: usize) -> f64 {
    1.0 / (d_model.max(1) as f64).sqrt()
}

/// SwiGLU width about 8/3·D, rounded to a multiple of 64 (docs/design.md §4).
pub fn swiglu_width(d_model: usize) -> usize {
    let w = (8 * d_model) as f64 / 3.0;
    ((w / 64.0).round() as usize).max(1) * 64
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl ModelConfig {
    fn base(family: Family, vocab: usize, d: usize, layers: usize, heads: usize, ff: usize, seq: usize) -> Self {
        ModelConfig {
            family,
            vocab_size: vocab,
            d_model: d,
            n_layers: layers,
            n_heads: heads,
            n_kv_heads: heads,
            head_dim: None,
            d_ff: ff,
            max_seq_len: seq,
            rope_theta: default_rope_theta(),
            rope_style: default_rope_style(),
            head_pairing: default_pairing(),
            subln: true,
            subln_affine: true,
            lambda_std: default_lambda_std(),
            tie_embeddings: false,
            norm_eps: default_norm_eps(),
            subln_eps: default_norm_eps(),
            init_std: preset_init_std(d),
        }
    }

    /// Named presets: `tiny` (fast tests and the README demo), `bench-s` (docs/design.md §4.3), `small` (~20M).
    pub fn preset(name: &str, family: Family) -> Result<Self, ConfigError> {
        let cfg = match name {
            "nano" => Self::base(family, 256, 64, 4, 4, swiglu_width(64), 256),
            "tiny" => Self::base(family, 256, 128, 4, 8, 320, 128),
            "bench-s" => Self::base(family, 256, 256, 6, 8, 704, 256),
            "small" => Self::base(family, 256, 512, 6, 8, swiglu_width(512), 512),
            _ => {
                return Err(ConfigError::Invalid(format!(
                    "unknown preset '{name}' (expected nano, tiny, bench-s or small)"
                )))
            }
        };
        Ok(cfg)
    }

    pub fn preset_names() -> &'static [&'static str] {
        &["nano", "tiny", "bench-s", "small"]
    }

    pub fn with_family(&self, family: Family) -> Self {
        ModelConfig { family, ..self.clone() }
    }

    /// Per-map head dim d.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Number of query heads the q projection produces (maps of dim d).
    pub fn n_q_proj_heads(&self) -> usize {
        match self.family {
            Family::Baseline | Family::DiffV1 => self.n_heads,
            Family::DiffV2 => 2 * self.n_heads,
        }
    }

    /// Number of key/value heads the k and v projections produce (maps of dim d).
    /// diff-v2 takes half the baseline's kv heads (docs/design.md §2.3): with n_kv_heads = H that is H/2,
    /// which makes its attention exactly parameter-matched to the MHA baseline (plus lambda_proj).
    pub fn n_kv_proj_heads(&self) -> usize {
        match self.family {
            Family::Baseline | Family::DiffV1 => self.n_kv_heads,
            Family::DiffV2 => (self.n_kv_heads / 2).max(1),
        }
    }

    /// Lambda_init of layer `l` (from 0): 0.8 - 0.6·exp(-0.3·l) (docs/design.md §1.2).
    pub fn lambda_init(layer: usize) -> f64 {
        0.8 - 0.6 * (-0.3 * layer as f64).exp()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.vocab_size == 0 || self.d_model == 0 || self.n_layers == 0 || self.n_heads == 0 {
            return bad("vocab_size, d_model, n_layers and n_heads must be positive".into());
        }
        if self.n_kv_heads == 0 || self.d_ff == 0 || self.max_seq_len == 0 {
            return bad("n_kv_heads, d_ff and max_seq_len must be positive".into());
        }
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.n_heads) {
            return bad(format!("d_model {} is not divisible by n_heads {}", self.d_model, self.n_heads));
        }
        let d = self.head_dim();
        if !d.is_multiple_of(2) {
            return bad(format!("head dim {d} must be even for RoPE"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!("n_kv_heads {} does not divide n_heads {}", self.n_kv_heads, self.n_heads));
        }
        match self.family {
            Family::Baseline => {}
            Family::DiffV1 => {
                if !self.n_heads.is_multiple_of(2) {
                    return bad(format!(
                        "diff-v1 needs an even n_heads (two maps per differential head), got {}",
                        self.n_heads
                    ));
                }
                if !self.n_kv_heads.is_multiple_of(2) {
                    return bad(format!(
                        "diff-v1 needs an even n_kv_heads (two key maps per kv group), got {}",
                        self.n_kv_heads
                    ));
                }
            }
            Family::DiffV2 => {
                let (q, kv) = (self.n_q_proj_heads(), self.n_kv_proj_heads());
                if q % kv != 0 || (q / kv) % 2 != 0 {
                    return bad(format!(
                        "diff-v2: {kv} kv heads cannot serve {q} query heads in pairs that share a kv group"
                    ));
                }
            }
        }
        // Written so that NaN is rejected too.
        let positive = |x: f64| x > 0.0;
        if !positive(self.rope_theta) || !positive(self.norm_eps) || !positive(self.subln_eps) {
            return bad("rope_theta, norm_eps and subln_eps must be positive".into());
        }
        Ok(())
    }

    /// The attention shapes of this config's family: the one place they are derived
    /// (`param_specs`, the model loader and `param_counts` all read them).
    pub fn attention_shapes(&self) -> AttentionShapes {
        let d = self.head_dim();
        let (n_q, n_kv) = (self.n_q_proj_heads(), self.n_kv_proj_heads());
        let diff_v1 = self.family == Family::DiffV1;
        AttentionShapes {
            head_dim: d,
            n_q,
            n_kv,
            q_out: n_q * d,
            kv_out: n_kv * d,
            // diff-v2 combines each pair of query heads into one output head of width d.
            o_in: match self.family {
                Family::DiffV2 => self.n_heads * d,
                Family::Baseline | Family::DiffV1 => n_q * d,
            },
            lambda_vec: diff_v1.then_some(d),
            subln_gain: (diff_v1 && self.subln && self.subln_affine).then_some(2 * d),
            lambda_proj_out: (self.family == Family::DiffV2).then_some(self.n_heads),
        }
    }

    /// Training FLOPs per token of a sequence of `seq_len` tokens (see [`TrainingFlops`]).
    /// Attention per query map and layer: `(seq_len + 1) / 2` keys on average, each costing
    /// `2·d` for the score and `2·w` for its weighted value of width `w`: d for baseline and
    /// diff-v2, 2d for diff-v1 (a map weighs its pair's two value heads side by side).
    pub fn training_flops_per_token(&self, seq_len: usize) -> TrainingFlops {
        let s = self.attention_shapes();
        let c = self.param_counts();
        let lambda_proj = self.n_layers * self.d_model * s.lambda_proj_out.unwrap_or(0);
        // A tied LM head is still a product with the (embedding) matrix.
        let head = self.vocab_size * self.d_model;
        let weights = c.attention_projections + lambda_proj + c.mlp + head;
        let value_width = if self.family == Family::DiffV1 { 2 * s.head_dim } else { s.head_dim };
        let mean_keys = (seq_len as f64 + 1.0) / 2.0;
        let forward_per_map = mean_keys * 2.0 * (s.head_dim + value_width) as f64;
        TrainingFlops {
            linear: 3.0 * 2.0 * weights as f64,
            attention: 3.0 * (self.n_layers * s.n_q) as f64 * forward_per_map,
        }
    }

    /// Parameter count by component, computed from shapes (matches the built model).
    pub fn param_counts(&self) -> ParamCounts {
        let d_model = self.d_model;
        let s = self.attention_shapes();
        let proj = s.projection_params(d_model);
        let extra = s.extra_params(d_model);
        let mlp = 3 * d_model * self.d_ff;
        let norms = 2 * d_model;
        let per_layer = proj + extra + mlp + norms;
        let embed = self.vocab_size * d_model;
        let head = if self.tie_embeddings { 0 } else { self.vocab_size * d_model };
        ParamCounts {
            embedding: embed,
            attention_projections: proj * self.n_layers,
            attention_extra: extra * self.n_layers,
            mlp: mlp * self.n_layers,
            norms: norms * self.n_layers + d_model,
            lm_head: head,
            total: embed + head + per_layer * self.n_layers + d_model,
        }
    }
}

/// Per-layer attention shapes of one family (docs/design.md §2). Weights are PyTorch-style
/// `[out, in]`: `q_proj [q_out, D]`, `k_proj`/`v_proj [kv_out, D]`, `o_proj [D, o_in]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShapes {
    /// Per-map head dim d.
    pub head_dim: usize,
    /// Query heads (maps of dim d) the q projection produces.
    pub n_q: usize,
    /// Key/value heads (maps of dim d) the k and v projections produce.
    pub n_kv: usize,
    pub q_out: usize,
    pub kv_out: usize,
    pub o_in: usize,
    /// diff-v1: length d of each of the four lambda vectors `lambda_{q1,k1,q2,k2}`.
    pub lambda_vec: Option<usize>,
    /// diff-v1 with `subln` and `subln_affine`: length 2d of the sub-layer norm gain.
    pub subln_gain: Option<usize>,
    /// diff-v2: rows H of `lambda_proj [H, D]`.
    pub lambda_proj_out: Option<usize>,
}

impl AttentionShapes {
    /// Weights of the q, k, v and o projections.
    pub fn projection_params(&self, d_model: usize) -> usize {
        d_model * (self.q_out + 2 * self.kv_out + self.o_in)
    }

    /// Lambda vectors and sub-layer norm gain (diff-v1), lambda projection (diff-v2).
    pub fn extra_params(&self, d_model: usize) -> usize {
        4 * self.lambda_vec.unwrap_or(0) + self.subln_gain.unwrap_or(0) + d_model * self.lambda_proj_out.unwrap_or(0)
    }
}

/// The arithmetic of one training step per token, in FLOPs (a multiply-add is 2), counted the
/// usual model-FLOPs way: the backward costs twice the forward, nothing is recomputed, and
/// element-wise work (norms, softmax, RoPE, λ, SwiGLU's gate) is left out. What a kernel really
/// does can be more (flash attention recomputes its scores in the backward and computes whole
/// diagonal tiles), so achieved FLOP/s from these counts is a lower bound on the kernels' own.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TrainingFlops {
    /// Products with weights: q, k, v, o (and diff-v2's λ projection), the MLP, the LM head.
    pub linear: f64,
    /// Causal attention: query t against its t + 1 visible keys, `q·k` and the weighted values.
    pub attention: f64,
}

impl TrainingFlops {
    pub fn total(&self) -> f64 {
        self.linear + self.attention
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ParamCounts {
    pub embedding: usize,
    pub attention_projections: usize,
    /// lambda vectors and sub-layer norm gain (diff-v1), lambda projection (diff-v2).
    pub attention_extra: usize,
    pub mlp: usize,
    pub norms: usize,
    pub lm_head: usize,
    pub total: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lambda_init_matches_spec() {
        let want = [0.2, 0.3555, 0.4707];
        for (l, w) in want.iter().enumerate() {
            assert!((ModelConfig::lambda_init(l) - w).abs() < 1e-4, "layer {l}");
        }
    }

    #[test]
    fn families_are_parameter_matched() {
        let base = ModelConfig::preset("bench-s", Family::Baseline).unwrap();
        let v1 = base.with_family(Family::DiffV1);
        let v2 = base.with_family(Family::DiffV2);
        let (pb, p1, p2) = (base.param_counts(), v1.param_counts(), v2.param_counts());
        assert_eq!(pb.attention_projections, p1.attention_projections);
        assert_eq!(pb.attention_projections, p2.attention_projections);
        let d = base.head_dim();
        assert_eq!(p1.total - pb.total, base.n_layers * 6 * d);
        assert_eq!(p2.total - pb.total, base.n_layers * base.d_model * base.n_heads);
    }

    #[test]
    fn invalid_configs_are_rejected() {
        let mut c = ModelConfig::preset("tiny", Family::DiffV1).unwrap();
        c.n_heads = 7;
        c.n_kv_heads = 7;
        c.d_model = 7 * 16;
        assert!(c.validate().unwrap_err().to_string().contains("even n_heads"));
        let mut c = ModelConfig::preset("tiny", Family::Baseline).unwrap();
        c.d_model = 130;
        assert!(c.validate().unwrap_err().to_string().contains("not divisible"));
        let mut c = ModelConfig::preset("tiny", Family::Baseline).unwrap();
        c.n_kv_heads = 3;
        assert!(c.validate().unwrap_err().to_string().contains("does not divide"));
    }

    #[test]
    fn config_json_round_trip() {
        let c = ModelConfig::preset("small", Family::DiffV2).unwrap();
        let s = serde_json::to_string(&c).unwrap();
        assert!(s.contains("\"diff-v2\""));
        let back: ModelConfig = serde_json::from_str(&s).unwrap();
        assert_eq!(c, back);
    }

    /// The linear FLOPs are 6 per weight of every matrix the model multiplies by (counted from
    /// `param_specs`, the embedding standing in for a tied head); the attention FLOPs equal a
    /// brute-force sum over query positions; on bench-s the attention arithmetic of diff-v1 and
    /// diff-v2 is 1.5 and 2 times the baseline's with the same linear arithmetic (+ λ_proj).
    #[test]
    fn training_flops_count_every_product() {
        for family in Family::ALL {
            for cfg in [
                ModelConfig::preset("bench-s", family).unwrap(),
                ModelConfig { n_kv_heads: 4, tie_embeddings: true, ..ModelConfig::preset("tiny", family).unwrap() },
                ModelConfig { head_dim: Some(10), ..ModelConfig::preset("tiny", family).unwrap() },
            ] {
                let specs = crate::model::param_specs(&cfg);
                let matrix = |s: &crate::model::ParamSpec| s.shape.len() == 2 && !s.name.contains("embed_tokens");
                let mut weights: usize = specs.iter().filter(|s| matrix(s)).map(|s| s.shape[0] * s.shape[1]).sum();
                if cfg.tie_embeddings {
                    weights += cfg.vocab_size * cfg.d_model;
                }
                let t = 37;
                let f = cfg.training_flops_per_token(t);
                assert_eq!(f.linear, 6.0 * weights as f64, "{family} linear");
                let s = cfg.attention_shapes();
                let w = if family == Family::DiffV1 { 2 * s.head_dim } else { s.head_dim };
                let keys: usize = (0..t).map(|q| q + 1).sum();
                let forward = cfg.n_layers * s.n_q * keys * 2 * (s.head_dim + w);
                assert!((f.attention * t as f64 - 3.0 * forward as f64).abs() < 1e-6, "{family} attention");
                assert_eq!(f.total(), f.linear + f.attention);
            }
        }
        let flops = |f| ModelConfig::preset("bench-s", f).unwrap().training_flops_per_token(256);
        let (b, v1, v2) = (flops(Family::Baseline), flops(Family::DiffV1), flops(Family::DiffV2));
        assert_eq!(v1.attention, 1.5 * b.attention);
        assert_eq!(v2.attention, 2.0 * b.attention);
        assert_eq!(v1.linear, b.linear);
        assert_eq!(v2.linear - b.linear, 6.0 * (6 * 256 * 8) as f64);
    }

    #[test]
    fn param_counts_equal_the_sum_of_param_specs() {
        let mut configs = Vec::new();
        for family in Family::ALL {
            for preset in ["tiny", "bench-s"] {
                configs.push(ModelConfig::preset(preset, family).unwrap());
            }
            let base = ModelConfig::preset("tiny", family).unwrap();
            configs.push(ModelConfig { n_kv_heads: 4, ..base.clone() }); // GQA
            configs.push(ModelConfig { tie_embeddings: true, ..base.clone() });
            configs.push(ModelConfig { head_dim: Some(10), n_kv_heads: 2, ..base.clone() });
            configs.push(ModelConfig { subln_affine: false, ..base.clone() });
            configs.push(ModelConfig { subln: false, ..base.clone() }); // gain ignored without the norm
            configs.push(ModelConfig { subln: false, subln_affine: false, n_kv_heads: 2, ..base });
        }
        for cfg in configs {
            cfg.validate().unwrap();
            let specs = crate::model::param_specs(&cfg);
            let n: usize = specs.iter().map(|s| s.shape.iter().product::<usize>()).sum();
            assert_eq!(n, cfg.param_counts().total, "{cfg:?}");
            let has_gain = specs.iter().any(|s| s.name.ends_with("subln.weight"));
            assert_eq!(has_gain, cfg.family == Family::DiffV1 && cfg.subln && cfg.subln_affine, "{cfg:?}");
        }
    }

    #[test]
    fn configs_without_subln_field_load_with_the_norm_on() {
        let c = ModelConfig::preset("tiny", Family::DiffV1).unwrap();
        let mut v = serde_json::to_value(&c).unwrap();
        v.as_object_mut().unwrap().remove("subln");
        let back: ModelConfig = serde_json::from_value(v).unwrap();
        assert!(back.subln);
    }
}
