//! The shared evaluation loop: report fields against each other and against a direct loss.

use candle_core::{DType, Device, Tensor};
use difftx_core::model::{init_weights, Model};
use difftx_core::tokenizer::Tokenizer;
use difftx_core::{Family, ModelConfig};
use difftx_train::eval::{evaluate_text, mean_loss, windows_to_batches};
use std::collections::HashMap;

fn tiny_model(family: Family) -> Model {
    let mut cfg = ModelConfig::preset("tiny", family).unwrap();
    cfg.d_model = 32;
    cfg.n_layers = 1;
    cfg.n_heads = 4;
    cfg.n_kv_heads = 4;
    cfg.d_ff = 48;
    cfg.max_seq_len = 16;
    let map: HashMap<_, _> = init_weights(&cfg, 3, DType::F32, &Device::Cpu).unwrap().into_iter().collect();
    Model::from_weights(&cfg, &map).unwrap()
}

fn texts() -> Vec<String> {
    vec!["The quick brown fox jumps over the lazy dog. ".repeat(3), "Pack my box with five dozen jugs.".into()]
}

#[test]
fn bits_per_byte_of_a_byte_model_is_loss_over_ln2() {
    let model = tiny_model(Family::DiffV1);
    let tok = Tokenizer::bytes();
    let r = evaluate_text(&model, &tok, &texts(), 8, 3, 100).unwrap();
    assert_eq!(r.bytes_per_token, 1.0);
    assert!((r.bits_per_byte - r.loss / std::f64::consts::LN_2).abs() < 1e-12, "{r:?}");
    assert!((r.perplexity - r.loss.exp()).abs() < 1e-9 * r.perplexity);
    // An untrained model is close to uniform over the 256 bytes.
    assert!((r.loss - (256f64).ln()).abs() < 0.5, "{r:?}");
    // 168 tokens: windows of 8 inputs from the start, (168 - 1) / 8 = 20 of them.
    let n: usize = texts().iter().map(|t| t.len()).sum();
    assert_eq!(r.tokens_evaluated, (n - 1) / 8 * 8);
    // At most max_batches batches of 3 windows.
    let r2 = evaluate_text(&model, &tok, &texts(), 8, 3, 2).unwrap();
    assert_eq!(r2.tokens_evaluated, 2 * 3 * 8);
}

#[test]
fn the_loop_equals_one_direct_loss() {
    let model = tiny_model(Family::Baseline);
    let tokens = Tokenizer::bytes().encode(&texts()[0]).unwrap();
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(9).map(|w| w.to_vec()).collect();
    let (batches, seq_len) = windows_to_batches(&windows, 2).unwrap();
    assert_eq!(seq_len, 8);
    let got = mean_loss(&model, &batches, seq_len).unwrap();
    let x: Vec<Vec<u32>> = windows.iter().map(|w| w[..8].to_vec()).collect();
    let y: Vec<Vec<u32>> = windows.iter().map(|w| w[1..].to_vec()).collect();
    let (x, y) = (Tensor::new(x, &Device::Cpu).unwrap(), Tensor::new(y, &Device::Cpu).unwrap());
    let want = Model::loss(&model.forward(&x, None).unwrap(), &y).unwrap().to_scalar::<f32>().unwrap() as f64;
    assert!((got - want).abs() < 1e-5, "{got} vs {want}");
}

#[test]
fn errors_are_one_line_and_actionable() {
    let model = tiny_model(Family::DiffV2);
    let tok = Tokenizer::bytes();
    let e = evaluate_text(&model, &tok, &["short".to_string()], 8, 2, 10).unwrap_err().to_string();
    assert!(e.contains("shorter than one sequence"), "{e}");
    let e = evaluate_text(&model, &tok, &texts(), 32, 2, 10).unwrap_err().to_string();
    assert!(e.contains("exceeds the model's context"), "{e}");
    assert!(windows_to_batches(&[], 2).is_err());
    assert!(windows_to_batches(&[vec![1, 2, 3], vec![1, 2]], 2).is_err());
}
