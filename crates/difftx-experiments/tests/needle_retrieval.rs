use candle_core::{DType, Device};
use difftx_core::tokenizer::Tokenizer;
use difftx_core::{Family, ModelConfig};
use difftx_experiments::mixture::{clean_text, read_corpus};
use difftx_experiments::needle::*;
use rand::SeedableRng;
use std::path::Path;

fn tiny_model(dir: &Path, family: Family) {
    let cfg = ModelConfig::preset("tiny", family).unwrap();
    let w = difftx_core::model::init_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
    difftx_core::checkpoint::save_model(dir, &cfg, &w).unwrap();
    Tokenizer::bytes().save_to_model_dir(dir).unwrap();
}

#[test]
fn prompts_hold_the_needles_at_their_depth_and_fit() {
    let tok = Tokenizer::bytes();
    let clean = clean_text(&read_corpus(None).unwrap()[..100_000]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for &(n, r, len) in &[(1, 1, 120), (2, 2, 200), (4, 2, 250), (6, 2, 250)] {
        for &depth in &[0.0, 0.5, 1.0] {
            let ps = needle_prompts(&tok, &clean, n, r, len, depth, &mut rng).unwrap().expect("fits");
            assert_eq!(ps.len(), r);
            for (text, ids, answer, span) in &ps {
                assert!(ids.len() <= len && ids.len() + 20 > len, "{} tokens for {len}", ids.len());
                assert_eq!(&text[span.clone()], answer);
                assert_eq!(text.matches("The magic number of").count(), n);
                let q = text.rfind("What is the magic number of ").unwrap();
                let key = &text[q + 28..q + 31];
                assert!(text.contains(&format!("The magic number of {key} is {answer}.")));
                let ctx_len = q as f64;
                let rel = span.start as f64 / ctx_len;
                assert!((rel - depth).abs() < 0.15 + (r as f64 * 31.0) / ctx_len, "depth {depth} but needle at {rel}");
            }
        }
    }
    // 6 needles cannot fit into 100 tokens
    assert!(needle_prompts(&tok, &clean, 6, 2, 100, 0.5, &mut rng).unwrap().is_none());
}

#[test]
fn untrained_model_fails_and_unfit_sweeps_are_null() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::DiffV1);
    let out = dir.path().join("out");
    let opts = NeedleOptions { sweeps: vec![(1, 1), (6, 2)], depths: vec![0.0, 100.0], trials: 2, ..Default::default() };
    let v = run_needle(dir.path(), &opts, &out).unwrap();
    assert!(out.join("needle.png").metadata().unwrap().len() > 1000);
    assert!(out.join("needle.json").exists());
    let s0 = &v["sweeps"][0];
    // a random model essentially never emits the right two digits
    assert!(s0["mean_accuracy"].as_f64().unwrap() < 0.25);
    // tiny context 128: lengths 63, 84, 105, 126; one needle + question need ~70 tokens
    assert_eq!(s0["context_lengths"], serde_json::json!([63, 84, 105, 126]));
    assert!(s0["accuracy"][0][0].is_null() && !s0["accuracy"][1][0].is_null());
    assert_eq!(s0["questions"].as_u64().unwrap() as usize, 3 * 2 * 2);
    // N=6 needs ~220 tokens, more than the tiny context of 128
    assert!(v["sweeps"][1]["mean_accuracy"].is_null());
    assert!(v["sweeps"][1]["accuracy"][0][0].is_null());
}

#[test]
fn bad_options_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::Baseline);
    let out = dir.path().join("o");
    let e = run_needle(dir.path(), &NeedleOptions { sweeps: vec![(1, 2)], ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("R=2"), "{e}");
    let e = run_needle(dir.path(), &NeedleOptions { context_lengths: vec![4096], ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    let e = run_needle(dir.path(), &NeedleOptions { sweeps: vec![(6, 2)], ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("too short"), "{e}");
    let e = run_needle(&dir.path().join("missing"), &NeedleOptions::default(), &out).unwrap_err();
    assert!(e.to_string().contains("cannot load"), "{e}");
}

/// An oracle that reads the prompt and answers the asked key's number; if `only_early`, it
/// answers "00" whenever that needle sits in the second half of the context.
fn oracle(tok: &Tokenizer, ids: &[u32], k: usize, only_early: bool) -> anyhow::Result<Vec<u32>> {
    let text = tok.decode(ids)?;
    let q = text.rfind("What is the magic number of ").unwrap();
    let key = &text[q + 28..q + 31];
    let pat = format!("The magic number of {key} is ");
    let at = text.find(&pat).unwrap();
    let value = &text[at + pat.len()..at + pat.len() + 2];
    let early = (at as f64) < q as f64 / 2.0;
    let ans = if only_early && !early { "00" } else { value };
    let ids = tok.encode(ans)?;
    assert_eq!(ids.len(), k);
    Ok(ids)
}

#[test]
fn oracle_answers_give_known_heatmaps() {
    let tok = Tokenizer::bytes();
    let opts = NeedleOptions { depths: vec![0.0, 100.0], trials: 2, ..Default::default() };
    let perfect = evaluate_needles(&tok, &opts, 256, &mut |ids, k| oracle(&tok, ids, k, false)).unwrap();
    assert_eq!(perfect["mean_accuracy"].as_f64().unwrap(), 1.0);
    // one asked needle, so depth 0 / 100% put it at the very start / end of the context
    let opts = NeedleOptions { sweeps: vec![(1, 1), (2, 1), (4, 1), (6, 1)], ..opts };
    let early = evaluate_needles(&tok, &opts, 256, &mut |ids, k| oracle(&tok, ids, k, true)).unwrap();
    let mut seen = 0;
    for sw in early["sweeps"].as_array().unwrap() {
        for row in sw["accuracy"].as_array().unwrap() {
            if row[0].is_null() {
                continue;
            }
            // asked needles at depth 0 are answered, at depth 100% are not
            assert_eq!(row[0].as_f64().unwrap(), 1.0, "{sw}");
            assert_eq!(row[1].as_f64().unwrap(), 0.0, "{sw}");
            seen += 1;
        }
    }
    // N=6 fits only the longest context of 256 tokens; all four sweeps are measured
    assert!(seen >= 4 + 3);
    assert!((early["mean_accuracy"].as_f64().unwrap() - 0.5).abs() < 1e-9);
}
