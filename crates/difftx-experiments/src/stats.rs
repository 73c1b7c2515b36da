//! Small-sample statistics for comparing families over seeds: mean, sample standard deviation,
//! a 95% confidence interval from Student's t, and a verdict on a paper's claim.

use serde::{Deserialize, Serialize};

/// Arithmetic mean; NaN for an empty slice.
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Sample standard deviation (divisor n - 1); NaN for fewer than two values.
pub fn sample_std(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return f64::NAN;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// Two-sided 95% critical value of Student's t with `df` degrees of freedom (df >= 1).
/// Exact table for df 1..=30, then a few anchors, then the normal 1.96. NaN for df = 0.
pub fn t_critical_95(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::NAN,
        1..=30 => TABLE[df - 1],
        31..=40 => 2.021,
        41..=60 => 2.000,
        61..=120 => 1.980,
        _ => 1.960,
    }
}

/// Mean, spread and 95% CI of a sample. `ci95` is None for fewer than two values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub std: Option<f64>,
    pub ci95: Option<(f64, f64)>,
}

impl Summary {
    /// Half-width of the 95% CI (None when it is undefined).
    pub fn half_width(&self) -> Option<f64> {
        self.ci95.map(|(lo, hi)| (hi - lo) / 2.0)
    }
    /// "m ± h" (or "m (n=1)" when the interval is undefined), with `digits` decimals.
    pub fn display(&self, digits: usize) -> String {
        match self.half_width() {
            Some(h) => format!("{:.*} ± {:.*}", digits, self.mean, digits, h),
            None if self.n == 0 => "n/a".to_string(),
            None => format!("{:.*} (n={})", digits, self.mean, self.n),
        }
    }
}

/// Summary of `xs`; non-finite values are dropped first.
pub fn summarize(xs: &[f64]) -> Summary {
    let v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    let m = mean(&v);
    let (std, ci95) = if v.len() >= 2 {
        let s = sample_std(&v);
        let h = t_critical_95(v.len() - 1) * s / (v.len() as f64).sqrt();
        (Some(s), Some((m - h, m + h)))
    } else {
        (None, None)
    };
    Summary { n: v.len(), mean: m, std, ci95 }
}

/// The sign the paper reports for (differential − baseline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Higher,
    Lower,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Reproduced,
    NotReproduced,
    Inconclusive,
}

impl Verdict {
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Reproduced => "reproduced",
            Verdict::NotReproduced => "not reproduced",
            Verdict::Inconclusive => "inconclusive",
        }
    }
}

/// Verdict on a claim from the summary of paired differences (differential − baseline):
/// the CI excludes zero on the paper's side → reproduced; on the other side → not reproduced;
/// includes zero (or is undefined) → inconclusive.
pub fn verdict(diff: &Summary, paper: Direction) -> Verdict {
    let Some((lo, hi)) = diff.ci95 else { return Verdict::Inconclusive };
    let (pos, neg) = (lo > 0.0, hi < 0.0);
    match (paper, pos, neg) {
        (Direction::Higher, true, _) | (Direction::Lower, _, true) => Verdict::Reproduced,
        (Direction::Higher, _, true) | (Direction::Lower, true, _) => Verdict::NotReproduced,
        _ => Verdict::Inconclusive,
    }
}

/// Element-wise differences `a[i] - b[i]` over pairs where both are finite (paired by seed).
pub fn paired_differences(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).filter(|(x, y)| x.is_finite() && y.is_finite()).map(|(x, y)| x - y).collect()
}
