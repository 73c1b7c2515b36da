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

/// Words kv of the default format (one letter, one digit).
fn needles_in(text: &str) -> Vec<&str> {
    text.split([' ', '\n'])
        .filter(|w| {
            let b = w.as_bytes();
            b.len() == 2 && b[0].is_ascii_lowercase() && b[1].is_ascii_digit()
        })
        .collect()
}

#[test]
fn prompts_hold_the_needles_at_their_depth_and_fit() {
    let tok = Tokenizer::bytes();
    let clean = clean_text(&read_corpus(None).unwrap()[..100_000]);
    let fmt = difftx_experiments::mixture::PairFormat::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for &(n, r, len) in &[(1, 1, 120), (2, 2, 200), (4, 2, 250), (6, 2, 250)] {
        for &depth in &[0.0, 0.5, 1.0] {
            let ps = needle_prompts(&tok, &clean, &fmt, n, r, len, depth, &mut rng).unwrap().expect("fits");
            assert_eq!(ps.len(), r);
            for (text, ids, answer, span) in &ps {
                assert!(ids.len() <= len && ids.len() + 20 > len, "{} tokens for {len}", ids.len());
                assert_eq!(&text[span.clone()], answer);
                let q = text.rfind('\n').unwrap();
                let (ctx, question) = (&text[..q], &text[q + 1..]);
                assert_eq!(needles_in(ctx).len(), n, "{text}");
                let key = question;
                assert!(needles_in(ctx).contains(&format!("{key}{answer}").as_str()));
                let rel = span.start as f64 / q as f64;
                assert!((rel - depth).abs() < 0.15 + (r as f64 * 3.0) / q as f64, "depth {depth} but needle at {rel}");
            }
        }
    }
    // 6 needles and a question cannot fit into 10 tokens
    assert!(needle_prompts(&tok, &clean, &fmt, 6, 2, 10, 0.5, &mut rng).unwrap().is_none());
}

#[test]
fn untrained_model_fails_and_unfit_sweeps_are_null() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::DiffV1);
    let out = dir.path().join("out");
    let opts =
        NeedleOptions { sweeps: vec![(1, 1), (6, 2)], depths: vec![0.0, 100.0], trials: 2, ..Default::default() };
    let v = run_needle(dir.path(), &opts, &out).unwrap();
    assert!(out.join("needle.png").metadata().unwrap().len() > 1000);
    assert!(out.join("needle.json").exists());
    let s0 = &v["sweeps"][0];
    // a random model is near chance (one digit: 10%)
    assert!(s0["mean_accuracy"].as_f64().unwrap() < 0.5);
    assert_eq!(v["chance_accuracy"].as_f64().unwrap(), 0.1);
    // tiny context 128: lengths 63, 84, 105, 127 (room for the one answer token)
    assert_eq!(s0["context_lengths"], serde_json::json!([63, 84, 105, 127]));
    assert_eq!(s0["questions"].as_u64().unwrap() as usize, 4 * 2 * 2);
    // short needles: N=6 fits every length
    assert!(!v["sweeps"][1]["accuracy"][0][0].is_null());
    let opts = NeedleOptions {
        sweeps: vec![(6, 2)],
        context_lengths: vec![10],
        depths: vec![0.0],
        trials: 1,
        ..Default::default()
    };
    let e = run_needle(dir.path(), &opts, &out).unwrap_err();
    assert!(e.to_string().contains("too short"), "{e}");
}

#[test]
fn bad_options_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::Baseline);
    let out = dir.path().join("o");
    let e = run_needle(dir.path(), &NeedleOptions { sweeps: vec![(1, 2)], ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("R=2"), "{e}");
    let e =
        run_needle(dir.path(), &NeedleOptions { context_lengths: vec![4096], ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    let e = run_needle(dir.path(), &NeedleOptions { sweeps: vec![(30, 2)], ..Default::default() }, &out).unwrap_err();
    assert!(e.to_string().contains("distinct keys"), "{e}");
    let e = run_needle(&dir.path().join("missing"), &NeedleOptions::default(), &out).unwrap_err();
    assert!(e.to_string().contains("cannot load"), "{e}");
}

/// An oracle that reads the prompt and answers the asked key's value; if `only_early`, it
/// answers a wrong digit whenever that needle sits in the second half of the context.
fn oracle(tok: &Tokenizer, ids: &[u32], k: usize, only_early: bool) -> anyhow::Result<Vec<u32>> {
    let text = tok.decode(ids)?;
    let q = text.rfind('\n').unwrap();
    let key = &text[q + 1..];
    let ctx = &text[..q];
    let is_needle =
        |w: &str| w.len() == key.len() + 1 && w.starts_with(key) && w.as_bytes()[key.len()].is_ascii_digit();
    let word = ctx.split(' ').find(|w| is_needle(w)).unwrap();
    let value = &word[key.len()..];
    let pos = ctx.find(word).unwrap();
    let early = (pos as f64) < q as f64 / 2.0;
    let wrong = if value == "0" { "1" } else { "0" };
    let ans = if only_early && !early { wrong } else { value };
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
    // short needles fit every context length: all four sweeps, four lengths each
    assert_eq!(seen, 4 * 4);
    assert!((early["mean_accuracy"].as_f64().unwrap() - 0.5).abs() < 1e-9);
}
