use difftx_core::tokenizer::Tokenizer;
use difftx_core::{Family, ModelConfig};
use difftx_experiments::mixture::PairFormat;
use difftx_experiments::recall::*;

/// A perfect associative memory for one-letter keys: inside a value (after a key and any
/// digits already read), predicts the next character of the value that followed that key's
/// earliest pair in the text; a space elsewhere.
fn oracle(tok: &Tokenizer, ids: &[u32]) -> anyhow::Result<Vec<u32>> {
    let text = tok.decode(ids)?;
    let b = text.as_bytes();
    let starts_pair = |m: usize| m == 0 || b[m - 1] == b' ' || b[m - 1] == b'\n';
    let mut out = Vec::with_capacity(ids.len());
    for i in 0..b.len() {
        let mut pred = b' ';
        // the key this position continues from
        let mut j = i;
        while j > 0 && b[j].is_ascii_digit() {
            j -= 1;
        }
        if b[j].is_ascii_lowercase() && starts_pair(j) {
            let first =
                (0..j).find(|&m| b[m] == b[j] && starts_pair(m) && b.get(m + 1).is_some_and(|c| c.is_ascii_digit()));
            if let Some(&c) = first.and_then(|m| b.get(m + 1 + (i - j))) {
                pred = c;
            }
        }
        out.push(pred as u32);
    }
    Ok(out)
}

#[test]
fn an_oracle_scores_everything_and_a_constant_scores_chance() {
    let tok = Tokenizer::bytes();
    let opts = RecallOptions { pair_counts: vec![4, 8, 16], documents: 30, ..Default::default() };
    let perfect = evaluate_recall(&tok, &opts, 256, &mut |ids| oracle(&tok, ids)).unwrap();
    assert_eq!(perfect["mean_accuracy"].as_f64().unwrap(), 1.0, "{perfect}");
    assert_eq!(perfect["by_pairs"][2]["queries"].as_u64().unwrap(), 30 * 16);
    // always "7": right exactly when the value is 7, about one time in ten
    let constant = evaluate_recall(&tok, &opts, 256, &mut |ids| Ok(vec![b'7' as u32; ids.len()])).unwrap();
    let acc = constant["mean_accuracy"].as_f64().unwrap();
    assert!((acc - 0.1).abs() < 0.04, "{acc}");
    assert_eq!(constant["chance_accuracy"].as_f64().unwrap(), 0.1);
}

#[test]
fn two_digit_values_need_both_digits() {
    let tok = Tokenizer::bytes();
    let pairs = PairFormat { key_len: 1, key_letters: 26, value_digits: 2 };
    let opts = RecallOptions { pair_counts: vec![6], documents: 10, pairs, ..Default::default() };
    // knows only the first digit: never fully right
    let half = evaluate_recall(&tok, &opts, 256, &mut |ids| {
        let mut p = oracle(&tok, ids)?;
        let text = tok.decode(ids)?;
        for (i, c) in text.bytes().enumerate() {
            if c.is_ascii_digit() && i >= 1 && text.as_bytes()[i - 1].is_ascii_lowercase() {
                p[i] = b'x' as u32; // the prediction after the first digit
            }
        }
        Ok(p)
    })
    .unwrap();
    assert_eq!(half["mean_accuracy"].as_f64().unwrap(), 0.0);
}

#[test]
fn documents_that_do_not_fit_are_skipped_and_nothing_fitting_is_an_error() {
    let tok = Tokenizer::bytes();
    let opts = RecallOptions { pair_counts: vec![2, 20], documents: 3, ..Default::default() };
    // 20 pairs need ~160 tokens: skipped in a context of 64
    let v = evaluate_recall(&tok, &opts, 64, &mut |ids| oracle(&tok, ids)).unwrap();
    assert!(v["by_pairs"][1]["accuracy"].is_null());
    assert_eq!(v["by_pairs"][1]["skipped_documents"].as_u64().unwrap(), 3);
    let e = evaluate_recall(&tok, &RecallOptions { pair_counts: vec![20], ..opts.clone() }, 64, &mut |ids| {
        oracle(&tok, ids)
    })
    .unwrap_err();
    assert!(e.to_string().contains("fits"), "{e}");
    let e = evaluate_recall(&tok, &RecallOptions { pair_counts: vec![30], ..opts }, 256, &mut |ids| oracle(&tok, ids))
        .unwrap_err();
    assert!(e.to_string().contains("distinct keys"), "{e}");
}

#[test]
fn runs_on_a_checkpoint_and_writes_json_and_png() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::preset("tiny", Family::DiffV2).unwrap();
    let w = difftx_core::model::init_weights(&cfg, 1, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    difftx_core::checkpoint::save_model(dir.path(), &cfg, &w).unwrap();
    Tokenizer::bytes().save_to_model_dir(dir.path()).unwrap();
    let out = dir.path().join("out");
    let v = run_recall(dir.path(), &RecallOptions { documents: 2, ..Default::default() }, &out).unwrap();
    assert!(out.join("recall.png").metadata().unwrap().len() > 500);
    assert!(out.join("recall.json").exists());
    assert!(v["mean_accuracy"].as_f64().unwrap() < 0.6);
}
