//! Model configuration: one serde struct for all three attention families.
//!
//! Head counts are always given in *baseline* terms (SPEC §1): `n_heads` is the baseline's head
//! count `H`, `n_kv_heads` its key/value head count. Each family derives its own layout from these,
//! so the three families built from one config are parameter-matched.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Which attention the model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// Standard multi-head attention (SPEC §1.1).
    Baseline,
    /// Differential attention of the paper (SPEC §1.2).
    DiffV1,
    /// Differential attention v2: per-token sigmoid lambda, no sub-layer norm (SPEC §1.3).
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

/// Which two projected heads form the two maps of differential head `j` (SPEC §1.4).
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
    /// Learnable gain of the diff-v1 sub-layer RMSNorm (official code: true; HF DiffLlama: false).
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

/// SwiGLU width about 8/3·D, rounded to a multiple of 64 (SPEC §2).
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
            subln_affine: true,
            lambda_std: default_lambda_std(),
            tie_embeddings: false,
            norm_eps: default_norm_eps(),
            subln_eps: default_norm_eps(),
            init_std: default_init_std(),
        }
    }

    /// Named presets: `tiny` (fast tests and the README demo), `bench-s` (SPEC §3), `small` (~20M).
    pub fn preset(name: &str, family: Family) -> Result<Self, ConfigError> {
        let cfg = match name {
            "tiny" => Self::base(family, 256, 128, 4, 8, 320, 128),
            "bench-s" => Self::base(family, 256, 256, 6, 8, 704, 256),
            "small" => Self::base(family, 256, 512, 6, 8, swiglu_width(512), 512),
            _ => {
                return Err(ConfigError::Invalid(format!(
                    "unknown preset '{name}' (expected tiny, bench-s or small)"
                )))
            }
        };
        Ok(cfg)
    }

    pub fn preset_names() -> &'static [&'static str] {
        &["tiny", "bench-s", "small"]
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
    /// diff-v2 takes half the baseline's kv heads (SPEC §1.3): with n_kv_heads = H that is H/2,
    /// which makes its attention exactly parameter-matched to the MHA baseline (plus lambda_proj).
    pub fn n_kv_proj_heads(&self) -> usize {
        match self.family {
            Family::Baseline | Family::DiffV1 => self.n_kv_heads,
            Family::DiffV2 => (self.n_kv_heads / 2).max(1),
        }
    }

    /// Lambda_init of layer `l` (from 0): 0.8 - 0.6·exp(-0.3·l) (SPEC §1.2).
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
        if self.head_dim.is_none() && self.d_model % self.n_heads != 0 {
            return bad(format!(
                "d_model {} is not divisible by n_heads {}",
                self.d_model, self.n_heads
            ));
        }
        let d = self.head_dim();
        if d % 2 != 0 {
            return bad(format!("head dim {d} must be even for RoPE"));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return bad(format!(
                "n_kv_heads {} does not divide n_heads {}",
                self.n_kv_heads, self.n_heads
            ));
        }
        match self.family {
            Family::Baseline => {}
            Family::DiffV1 => {
                if self.n_heads % 2 != 0 {
                    return bad(format!(
                        "diff-v1 needs an even n_heads (two maps per differential head), got {}",
                        self.n_heads
                    ));
                }
                if self.n_kv_heads % 2 != 0 {
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
        if !(self.rope_theta > 0.0) || !(self.norm_eps > 0.0) || !(self.subln_eps > 0.0) {
            return bad("rope_theta, norm_eps and subln_eps must be positive".into());
        }
        Ok(())
    }

    /// Parameter count by component, computed from shapes (matches the built model).
    pub fn param_counts(&self) -> ParamCounts {
        let d_model = self.d_model;
        let d = self.head_dim();
        let q = self.n_q_proj_heads() * d;
        let kv = self.n_kv_proj_heads() * d;
        let out_in = match self.family {
            Family::DiffV2 => self.n_heads * d,
            _ => q,
        };
        let proj = d_model * q + 2 * d_model * kv + out_in * d_model;
        let extra = match self.family {
            Family::Baseline => 0,
            Family::DiffV1 => 4 * d + if self.subln_affine { 2 * d } else { 0 },
            Family::DiffV2 => d_model * self.n_heads,
        };
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
}
