use candle_core::{DType, Device, Tensor};
use difftx_core::model::Model;
use difftx_core::tokenizer::Tokenizer;
use difftx_core::{Family, ModelConfig};
use difftx_experiments::icl::*;
use std::path::Path;

fn tiny_model(dir: &Path, family: Family) {
    tiny_model_ctx(dir, family, 128)
}

fn tiny_model_ctx(dir: &Path, family: Family, ctx: usize) {
    let mut cfg = ModelConfig::preset("tiny", family).unwrap();
    cfg.max_seq_len = ctx;
    let w = difftx_core::model::init_weights(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    difftx_core::checkpoint::save_model(dir, &cfg, &w).unwrap();
    Tokenizer::bytes().save_to_model_dir(dir).unwrap();
}

#[test]
fn logprob_matches_cross_entropy() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::DiffV1);
    let model = difftx_core::checkpoint::load_runnable(dir.path(), &Device::Cpu).unwrap();
    let prompt: Vec<u32> = b"abc -> red\nxyz ->".iter().map(|&b| b as u32).collect();
    let cont: Vec<u32> = b" blue".iter().map(|&b| b as u32).collect();
    let lp = continuation_logprob(&model, &prompt, &cont).unwrap();
    // independent computation: mean cross-entropy over the continuation positions
    let mut ids = prompt.clone();
    ids.extend_from_slice(&cont);
    let x = Tensor::new(&ids[..ids.len() - 1], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let logits = model.forward(&x, None).unwrap();
    let p = prompt.len() - 1;
    let sub = logits.narrow(1, p, cont.len()).unwrap();
    let tgt = Tensor::new(cont.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let ce = Model::loss(&sub, &tgt).unwrap().to_scalar::<f32>().unwrap() as f64;
    assert!((lp + ce * cont.len() as f64).abs() < 1e-3, "{lp} vs {}", -ce * cont.len() as f64);
    assert!(lp < 0.0);
    assert!(continuation_logprob(&model, &prompt, &[]).is_err());
}

#[test]
fn order_stats_known_values() {
    let (m, margin) = order_stats(&[0.5, 0.75, 0.25, 1.0]);
    assert!((m - 0.625).abs() < 1e-12);
    assert!((margin - 0.75).abs() < 1e-12);
    assert_eq!(order_stats(&[0.4]).1, 0.0);
}

#[test]
fn synthetic_run_reports_orders_and_margin() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::Baseline);
    let out = dir.path().join("out");
    let opts = IclOptions { shots: 4, orders: 3, episodes: 2, queries: 4, ..Default::default() };
    let v = run_icl(dir.path(), &opts, &out).unwrap();
    assert!(out.join("icl.png").metadata().unwrap().len() > 1000);
    assert!(out.join("icl.json").exists());
    let eps = v["episodes"].as_array().unwrap();
    assert_eq!(eps.len(), 2);
    let mut margins = Vec::new();
    for e in eps {
        let accs: Vec<f64> = e["order_accuracies"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert_eq!(accs.len(), 3);
        // accuracies are multiples of 1/4 in [0, 1]
        for a in &accs {
            assert!((a * 4.0 - (a * 4.0).round()).abs() < 1e-9 && (0.0..=1.0).contains(a));
        }
        let (_, m) = order_stats(&accs);
        assert!((e["margin"].as_f64().unwrap() - m).abs() < 1e-12);
        margins.push(m);
    }
    assert!((v["margin"].as_f64().unwrap() - (margins[0] + margins[1]) / 2.0).abs() < 1e-12);
    assert_eq!(v["chance_accuracy"].as_f64().unwrap(), 0.5);
    // deterministic
    let again = run_icl(dir.path(), &opts, &dir.path().join("out2")).unwrap();
    assert_eq!(v["episodes"], again["episodes"]);
}

#[test]
fn data_file_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::DiffV2);
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/eval/snips_intent.jsonl");
    // snips sentences are long: 8 shots do not fit the tiny context
    let e = run_icl(dir.path(), &IclOptions { data: Some(data.clone()), ..Default::default() }, &dir.path().join("o")).unwrap_err();
    assert!(e.to_string().contains("context"), "{e}");
    let long = tempfile::tempdir().unwrap();
    tiny_model_ctx(long.path(), Family::DiffV2, 512);
    let v = run_icl(long.path(), &IclOptions { data: Some(data), shots: 2, orders: 1, episodes: 1, queries: 2, ..Default::default() }, &dir.path().join("o")).unwrap();
    assert_eq!(v["episodes"][0]["labels"].as_array().unwrap().len(), 7);
    let e = run_icl(dir.path(), &IclOptions { classes: 1, ..Default::default() }, &dir.path().join("o")).unwrap_err();
    assert!(e.to_string().contains("classes"), "{e}");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"a\"}\n").unwrap();
    let e = run_icl(dir.path(), &IclOptions { data: Some(bad), ..Default::default() }, &dir.path().join("o")).unwrap_err();
    assert!(e.to_string().contains("label"), "{e}");
}

fn parse(tok: &Tokenizer, prompt: &[u32], label: &[u32]) -> (Vec<(String, String)>, String, String) {
    let text = tok.decode(prompt).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let demos = lines[..lines.len() - 1].iter().map(|l| {
        let (x, y) = l.split_once(" -> ").unwrap();
        (x.to_string(), y.to_string())
    }).collect();
    let query = lines.last().unwrap().trim_end_matches(" ->").to_string();
    (demos, query, tok.decode(label).unwrap().trim().to_string())
}

#[test]
fn oracle_scorers_give_known_accuracy_and_margin() {
    let tok = Tokenizer::bytes();
    let opts = IclOptions { shots: 6, classes: 2, orders: 8, episodes: 3, queries: 7, ..Default::default() };
    // knows the rule (first letter a-m vs n-z) and reads the label words off the demonstrations
    let v = evaluate_icl(&tok, &opts, &mut |p, l| {
        let (demos, q, label) = parse(&tok, p, l);
        let group = |s: &str| s.as_bytes()[0] < b'n';
        let right = demos.iter().find(|(x, _)| group(x) == group(&q)).map(|(_, y)| y.clone()).unwrap();
        Ok(if label == right { 0.0 } else { -1.0 })
    })
    .unwrap();
    assert_eq!(v["mean_accuracy"].as_f64().unwrap(), 1.0);
    assert_eq!(v["margin"].as_f64().unwrap(), 0.0);
    assert_eq!(v["chance_accuracy"].as_f64().unwrap(), 0.5);
    // recency bias: always the last demonstration's label -> accuracy depends on the order
    let v = evaluate_icl(&tok, &opts, &mut |p, l| {
        let (demos, _, label) = parse(&tok, p, l);
        Ok(if label == demos.last().unwrap().1 { 0.0 } else { -1.0 })
    })
    .unwrap();
    let acc = v["mean_accuracy"].as_f64().unwrap();
    assert!(acc > 0.1 && acc < 0.9, "{acc}");
    assert!(v["margin"].as_f64().unwrap() > 0.0);
    for e in v["episodes"].as_array().unwrap() {
        let accs: Vec<f64> = e["order_accuracies"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        // with 2 labels, the last demo's label is right on the queries of its class only:
        // every order's accuracy is the share of one class among the 7 queries (never 1/2)
        let a0 = accs[0];
        assert!(accs.iter().all(|a| (*a - a0).abs() < 1e-12 || (*a - (1.0 - a0)).abs() < 1e-12), "{accs:?}");
    }
}
