//! Small-sample statistics for comparing families over seeds: mean, sample standard deviation,
//! a 95% confidence interval from Student's t, a verdict on a paper's claim, a guard that marks a
//! comparison uninformative when the reference family sits at an accuracy floor or ceiling, and
//! the minimum detectable effect (power analysis) of a paired comparison.

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

/// One-sided 0.80 quantile of Student's t with `df` degrees of freedom (the t value that gives 80%
/// power in [`min_detectable_effect`]). Exact table for df 1..=30, then anchors at 40, 60, 120 (a
/// range uses the value at its upper end, as [`t_critical_95`] does), then the normal 0.842.
/// NaN for df = 0.
pub fn t_quantile_80(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866, 0.865,
        0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854,
    ];
    match df {
        0 => f64::NAN,
        1..=30 => TABLE[df - 1],
        31..=40 => 0.851,
        41..=60 => 0.848,
        61..=120 => 0.845,
        _ => 0.842,
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
    /// The comparison cannot speak to the claim: the reference family is at an accuracy floor or
    /// ceiling (see [`accuracy_guard`]), so a difference (or its absence) says nothing.
    Uninformative,
}

impl Verdict {
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Reproduced => "reproduced",
            Verdict::NotReproduced => "not reproduced",
            Verdict::Inconclusive => "inconclusive",
            Verdict::Uninformative => "uninformative",
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

/// Guard for accuracy-type metrics: `Some(reason)` when the reference family's mean accuracy
/// leaves no room to see an effect, None when the comparison is informative.
/// - floor: below `chance + 0.10·(1 − chance)` (10% when chance is 0): the reference does no better
///   than guessing, so "diff is higher" may only mean "diff learned the format";
/// - ceiling: above 0.90: both families solve the task, so no difference can show;
/// - "undefined": the mean (or chance) is not finite.
pub fn accuracy_guard(reference_mean: f64, chance: f64) -> Option<String> {
    if !reference_mean.is_finite() || !chance.is_finite() {
        return Some(format!("undefined: reference accuracy {reference_mean} (chance {chance}) is not a number"));
    }
    let floor = chance + 0.10 * (1.0 - chance);
    if reference_mean < floor {
        return Some(format!(
            "floor: reference accuracy {reference_mean:.3} is below {floor:.3} \
             (chance {chance:.3} + 10% of the headroom)"
        ));
    }
    if reference_mean > 0.90 {
        return Some(format!("ceiling: reference accuracy {reference_mean:.3} is above 0.900"));
    }
    None
}

/// [`verdict`], or [`Verdict::Uninformative`] when `guard` (from [`accuracy_guard`]) gave a reason.
pub fn guarded_verdict(diff: &Summary, paper: Direction, guard: Option<&str>) -> Verdict {
    if guard.is_some() {
        Verdict::Uninformative
    } else {
        verdict(diff, paper)
    }
}

/// Minimum detectable effect of a paired comparison: the smallest true mean difference that a
/// two-sided test at the 95% level would detect with 80% power, given the spread of the observed
/// paired differences (one per seed):
/// `MDE = (t_{0.975, n−1} + t_{0.80, n−1}) · s / √n`, with `s` the sample standard deviation of the
/// differences and `n` the number of seeds (the usual normal-approximation power formula with t
/// quantiles in place of z). An observed effect well below the MDE with an inconclusive verdict
/// means "this run was too small to tell", not "no effect". None for fewer than two differences
/// or a non-finite spread; 0 when all differences are equal.
pub fn min_detectable_effect(diffs: &Summary) -> Option<f64> {
    let s = diffs.std?;
    if diffs.n < 2 || !s.is_finite() {
        return None;
    }
    let df = diffs.n - 1;
    Some((t_critical_95(df) + t_quantile_80(df)) * s / (diffs.n as f64).sqrt())
}
