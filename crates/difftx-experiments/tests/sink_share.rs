use candle_core::{Device, Tensor};
use difftx_core::tokenizer::Tokenizer;
use difftx_experiments::attention::*;

fn rows_map(heads: &[Vec<Vec<f32>>]) -> Tensor {
    let (h, t, s) = (heads.len(), heads[0].len(), heads[0][0].len());
    let v: Vec<f32> = heads.iter().flatten().flatten().copied().collect();
    Tensor::from_vec(v, (h, t, s), &Device::Cpu).unwrap()
}

/// Positions 0 and 2 are punctuation; position 0 never counts as punctuation.
const PUNCT: [bool; 4] = [true, false, true, false];

#[test]
fn hand_built_map_has_the_known_sink_shares() {
    let m = rows_map(&[
        vec![vec![1.0, 0.0, 0.0, 0.0], vec![0.5, 0.5, 0.0, 0.0], vec![0.5, 0.25, 0.25, 0.0], vec![0.25; 4]],
        // signed rows; row 2 is all zero and is skipped
        vec![vec![1.0, 0.0, 0.0, 0.0], vec![1.0, -0.5, 0.0, 0.0], vec![0.0; 4], vec![0.6, 0.2, -0.2, 0.4]],
    ]);
    let s = sink_shares(&m, &PUNCT).unwrap();
    assert_eq!(s.rows, 5);
    let first = (0.5 + 0.5 + 0.25 + 1.0 / 1.5 + 0.6 / 1.4) / 5.0;
    let punct = (0.0 + 0.25 + 0.25 + 0.0 + 0.2 / 1.4) / 5.0;
    assert!((s.first_token_share - first).abs() < 1e-6, "{s:?}");
    assert!((s.punct_share - punct).abs() < 1e-6, "{s:?}");
    // batched form
    assert_eq!(sink_shares(&m.unsqueeze(0).unwrap(), &PUNCT).unwrap(), s);
    // layers weigh the same
    let z = Tensor::zeros((2, 4, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let all_first = rows_map(&vec![vec![vec![1.0, 0.0, 0.0, 0.0]; 4]; 2]);
    let l = sink_over_layers(&[m.clone(), all_first, z], &PUNCT).unwrap();
    assert!((l.first_token_share - (first + 1.0) / 2.0).abs() < 1e-6, "{l:?}");
    assert!((l.punct_share - punct / 2.0).abs() < 1e-6, "{l:?}");
    assert_eq!(l.rows, 5 + 6);
    // errors
    assert!(sink_shares(&m, &PUNCT[..3]).is_err());
    assert!(sink_over_layers(&[], &PUNCT).is_err());
    let zs = sink_shares(&rows_map(&[vec![vec![0.0; 4]; 4]]), &PUNCT).unwrap();
    assert!(zs.first_token_share.is_nan() && zs.rows == 0);
}

#[test]
fn uniform_causal_map_matches_the_uniform_reference() {
    let (uf, up) = uniform_causal_shares(&PUNCT);
    assert!((uf - (1.0 / 2.0 + 1.0 / 3.0 + 1.0 / 4.0) / 3.0).abs() < 1e-12);
    assert!((up - (0.0 + 1.0 / 3.0 + 1.0 / 4.0) / 3.0).abs() < 1e-12);
    let t = 6;
    let punct = [false, true, false, false, true, true];
    let row = |i: usize| -> Vec<f32> { (0..t).map(|j| if j <= i { 1.0 / (i + 1) as f32 } else { 0.0 }).collect() };
    let rows: Vec<Vec<f32>> = (0..t).map(row).collect();
    let s = sink_shares(&rows_map(&[rows.clone(), rows]), &punct).unwrap();
    let (uf, up) = uniform_causal_shares(&punct);
    assert!((s.first_token_share - uf).abs() < 1e-6 && (s.punct_share - up).abs() < 1e-6, "{s:?} {uf} {up}");
    assert!(uniform_causal_shares(&[true]).0.is_nan());
}

#[test]
fn punctuation_and_newline_tokens() {
    for p in [".", ",", " ,", "\n", ".\n", "?!", " \n "] {
        assert!(is_punct_or_newline(p), "{p:?}");
    }
    for p in ["a", " ", "", "a.", " the", "7"] {
        assert!(!is_punct_or_newline(p), "{p:?}");
    }
    let tok = Tokenizer::bytes();
    let ids = tok.encode("Hi, you.\nOk").unwrap();
    let m = punct_mask(&tok, &ids).unwrap();
    let want: Vec<bool> = "Hi, you.\nOk".chars().map(|c| matches!(c, ',' | '.' | '\n')).collect();
    assert_eq!(m, want);
}
