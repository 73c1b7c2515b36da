//! The paper's claims that `compare` measures, one table: what each claim says, the paper's
//! numbers (quoted from the paper's text, as checked in the project's notes), which instrument
//! measures it, how to read the number from that instrument's JSON, and how to judge it.

use crate::stats::Direction;
use serde::Serialize;

/// How a claim's numbers may be judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimKind {
    /// An accuracy: judged only when the reference family is off the floor and the ceiling
    /// (the chance level is read from the instrument's `chance_accuracy`).
    Accuracy,
    /// Judged only when the reference family's accuracy at (instrument, pointer) is informative:
    /// the order margin of an in-context task nobody can do, or where attention goes in models
    /// that do not retrieve, is no evidence either way.
    GuardedBy(&'static str, &'static str),
    /// A continuous quantity, always judged.
    Continuous,
    /// A quantity that differs between families by construction (e.g. raw masses of a signed
    /// map whose rows sum to 1 − λ): reported, never judged.
    ByConstruction,
}

/// One claim, read from one instrument's JSON by a JSON pointer.
#[derive(Debug, Clone, Serialize)]
pub struct ClaimSpec {
    pub id: String,
    pub title: String,
    /// What the paper reports, with its numbers.
    pub paper: String,
    /// The instrument whose JSON holds the number ("train", "needle", "recall", ...).
    pub instrument: String,
    /// JSON pointer into the instrument's result, e.g. "/mean_accuracy".
    pub pointer: String,
    /// The paper's sign of (differential − baseline).
    pub direction: Direction,
    pub kind: ClaimKind,
}

/// The paper's multi-needle table (4K context, Table 2): (N, R) -> (Transformer, DIFF).
pub const PAPER_NEEDLE: [((usize, usize), (f64, f64)); 4] =
    [((1, 1), (1.00, 1.00)), ((2, 2), (0.85, 0.92)), ((4, 2), (0.62, 0.84)), ((6, 2), (0.55, 0.85))];

/// Where the paper's numbers come from, for the report.
pub const PAPER_SOURCE: &str = "Ye et al., \"Differential Transformer\", ICLR 2025 (arXiv 2410.05258); numbers read \
     from the paper's text: Fig. 3 and Table 8 (language modelling), Table 2 (multi-needle, 4K context), Table 3 \
     (attention allocation), pp. 7-8 (in-context learning), Table 5 (activation outliers), Fig. 8 (attention-logit \
     quantisation), Table 6 (ablations, 1.4B)";

/// Every claim, for needle sweeps `sweeps` and recall pair counts `recall_pairs`.
pub fn claims(sweeps: &[(usize, usize)], recall_pairs: &[usize]) -> Vec<ClaimSpec> {
    use ClaimKind::*;
    use Direction::*;
    let c = |instrument: &str, id: &str, title: &str, paper: &str, pointer: &str, direction, kind| ClaimSpec {
        id: id.into(),
        title: title.into(),
        paper: paper.into(),
        instrument: instrument.into(),
        pointer: pointer.into(),
        direction,
        kind,
    };
    let mut v = vec![
        c(
            "train",
            "val_loss",
            "Validation loss on the training mixture at equal parameters and tokens",
            "DIFF needs about 65% of the Transformer's parameters or tokens for the same loss (Fig. 3), so its loss \
             is lower at equal budget; same-recipe 3B: 0-shot average 56.2 vs 55.4 (Table 8)",
            "/final_val_loss",
            Lower,
            Continuous,
        ),
        c(
            "train",
            "text_loss",
            "Loss on real text at equal parameters and tokens",
            "DIFF needs about 65% of the Transformer's parameters or tokens for the same loss (Fig. 3), so its loss \
             is lower at equal budget",
            "/text_loss",
            Lower,
            Continuous,
        ),
        c(
            "needle",
            "needle_all",
            "Multi-needle retrieval accuracy, all sweeps",
            "higher for DIFF at every N/R (Table 2, 4K context)",
            "/mean_accuracy",
            Higher,
            Accuracy,
        ),
    ];
    for (i, &(n, r)) in sweeps.iter().enumerate() {
        let paper = match PAPER_NEEDLE.iter().find(|x| x.0 == (n, r)) {
            Some((_, (t, d))) => format!("Transformer {t:.2}, DIFF {d:.2} (Table 2, 4K context)"),
            None => "not in the paper's table; higher for DIFF expected".into(),
        };
        v.push(c(
            "needle",
            &format!("needle_n{n}r{r}"),
            &format!("Needle accuracy N={n}, R={r}"),
            &paper,
            &format!("/sweeps/{i}/mean_accuracy"),
            Higher,
            Accuracy,
        ));
    }
    v.push(c(
        "recall",
        "recall_all",
        "Associative recall (MQAR) accuracy, all pair counts",
        "not a paper experiment; the paper's retrieval results (Table 2) predict higher for DIFF",
        "/mean_accuracy",
        Higher,
        Accuracy,
    ));
    for (i, p) in recall_pairs.iter().enumerate() {
        v.push(c(
            "recall",
            &format!("recall_p{p}"),
            &format!("Associative recall accuracy, {p} pairs"),
            "not a paper experiment; higher for DIFF expected",
            &format!("/by_pairs/{i}/accuracy"),
            Higher,
            Accuracy,
        ));
    }
    v.extend([
        c(
            "attention",
            "attn_answer_alloc",
            "Attention allocated to the answer span (share of the row's absolute mass)",
            "answer span: Transformer .03-.09, DIFF .27-.40 by depth (Table 3)",
            "/mean_answer_alloc",
            Higher,
            GuardedBy("needle", "/mean_accuracy"),
        ),
        c(
            "attention",
            "attn_noise_alloc",
            "Attention allocated to the rest of the context (share of the row's absolute mass)",
            "noise context: Transformer .49-.54, DIFF .01-.02 by depth (Table 3)",
            "/mean_noise_alloc",
            Lower,
            GuardedBy("needle", "/mean_accuracy"),
        ),
        c(
            "attention",
            "attn_best_head",
            "Best retrieval head's answer allocation",
            "not reported per head; higher for DIFF expected from Table 3",
            "/best_head/answer_alloc",
            Higher,
            GuardedBy("needle", "/mean_accuracy"),
        ),
        c(
            "attention",
            "attn_answer_mass",
            "Raw attention mass on the answer span",
            "Table 3 (see the allocation rows: raw masses of A1 − λ·A2 are smaller by construction)",
            "/mean_answer_mass",
            Higher,
            ByConstruction,
        ),
        c(
            "attention",
            "attn_noise_mass",
            "Raw attention mass on the rest of the context",
            "Table 3 (a differential row sums to about 1 − λ, so this is lower by construction)",
            "/mean_noise_mass",
            Lower,
            ByConstruction,
        ),
        c(
            "attention",
            "sink_first",
            "Attention-sink share: attention on the first token",
            "not a paper number; the source article says DIFF stops dumping surplus attention on the first token",
            "/sink/first_token_share",
            Lower,
            Continuous,
        ),
        c(
            "attention",
            "sink_punct",
            "Attention on punctuation and newline tokens",
            "not a paper number; the source article says DIFF stops dumping surplus attention on punctuation",
            "/sink/punct_share",
            Lower,
            Continuous,
        ),
        c(
            "icl",
            "icl_acc",
            "In-context classification accuracy (mean over demonstration orders)",
            "many-shot gains of +5.2 to +21.6 points for DIFF (TREC +18.0, TREC-fine +21.6, Banking-77 +10.4, \
             Clinic-150 +5.2)",
            "/mean_accuracy",
            Higher,
            Accuracy,
        ),
        c(
            "icl",
            "icl_margin",
            "Best − worst accuracy over demonstration orders",
            "smaller for DIFF: TREC random order 19.0 vs 4.0 points, alternating 56.7 vs 13.4, Banking-77 13.0 vs \
             9.0, Clinic-150 12.0 vs 6.0",
            "/margin",
            Lower,
            GuardedBy("icl", "/mean_accuracy"),
        ),
        c(
            "outliers",
            "outlier_logits",
            "Largest |attention logit| (top-1)",
            "Transformer 318.0 vs DIFF 38.8 (Table 5)",
            "/attention_logits/all_layers/top1",
            Lower,
            Continuous,
        ),
        c(
            "outliers",
            "outlier_hidden",
            "Largest |hidden state| (top-1)",
            "Transformer 3608.6 vs DIFF 1688.2 (Table 5)",
            "/hidden_states/all_layers/top1",
            Lower,
            Continuous,
        ),
        c(
            "quantize",
            "quant_logits4",
            "Loss increase with 4-bit attention logits",
            "DIFF keeps its accuracy down to 6 bits, the Transformer drops at 6; 4-bit DIFF beats 4-bit Transformer \
             by about 25 points (Fig. 8, HellaSwag; values not printed)",
            "/delta_by_setting/logits int4",
            Lower,
            Continuous,
        ),
        c(
            "quantize",
            "quant_w4",
            "Loss increase with int4 weights (per channel)",
            "not a paper experiment; the source article claims easier low-bit quantisation",
            "/delta_by_setting/W4 per-channel",
            Lower,
            Continuous,
        ),
        c(
            "quantize",
            "quant_w4a4",
            "Loss increase with W4A4",
            "not a paper experiment; the source article claims W4A4 with little loss",
            "/delta_by_setting/W4A4",
            Lower,
            Continuous,
        ),
    ]);
    v
}

/// The paper's parameter- and token-efficiency numbers (Fig. 3).
pub const PAPER_PARAM_RATIO: &str = "6.8B DIFF ≈ 11B Transformer (62.2%), 7.8B DIFF ≈ 13.1B Transformer (59.5%)";
pub const PAPER_TOKEN_RATIO: &str = "3B: DIFF at 160B tokens ≈ Transformer at 251B (63.7%)";
/// The paper's norm ablation (Table 6, 1.4B, validation loss).
pub const PAPER_ABLATION: &str = "DIFF 3.062, DIFF without GroupNorm 3.122, Transformer 3.087 (Table 6, 1.4B)";
