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
    assert_eq!(v["chance_accuracy"].as_f64().unwrap(), 1.0 / opts.classes as f64);
    // deterministic
    let again = run_icl(dir.path(), &opts, &dir.path().join("out2")).unwrap();
    assert_eq!(v["episodes"], again["episodes"]);
}

#[test]
fn data_file_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path(), Family::DiffV2);
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/eval/snips_intent.jsonl");
    // snips sentences are long: 8 shots do not fit the tiny context as they are, so texts are
    // truncated (and demonstrations dropped if needed) instead of failing
    let small = IclOptions { data: Some(data.clone()), orders: 1, episodes: 1, queries: 2, ..Default::default() };
    let v = run_icl(dir.path(), &small, &dir.path().join("o")).unwrap();
    let changed = v["skipped_examples"].as_u64().unwrap() + v["truncated_examples"].as_u64().unwrap();
    assert!(changed > 0, "{v}");
    assert!(v["note"].as_str().unwrap().contains("context of 128 tokens"), "{v}");
    assert_eq!(v["max_tokens"].as_u64().unwrap(), 128);
    // a context too small for one demonstration plus a query is a one-line error
    let tiny = tempfile::tempdir().unwrap();
    tiny_model_ctx(tiny.path(), Family::DiffV2, 24);
    let e = run_icl(tiny.path(), &small, &dir.path().join("o")).unwrap_err();
    assert!(e.to_string().contains("not even one demonstration"), "{e}");
    assert!(!e.to_string().contains('\n'), "{e}");
    let long = tempfile::tempdir().unwrap();
    tiny_model_ctx(long.path(), Family::DiffV2, 512);
    let v = run_icl(
        long.path(),
        &IclOptions { data: Some(data), shots: 2, orders: 1, episodes: 1, queries: 2, ..Default::default() },
        &dir.path().join("o"),
    )
    .unwrap();
    assert_eq!(v["episodes"][0]["labels"].as_array().unwrap().len(), 7);
    let e = run_icl(dir.path(), &IclOptions { classes: 1, ..Default::default() }, &dir.path().join("o")).unwrap_err();
    assert!(e.to_string().contains("classes"), "{e}");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"a\"}\n").unwrap();
    let e =
        run_icl(dir.path(), &IclOptions { data: Some(bad), ..Default::default() }, &dir.path().join("o")).unwrap_err();
    assert!(e.to_string().contains("label"), "{e}");
}

fn parse(tok: &Tokenizer, prompt: &[u32], label: &[u32]) -> (Vec<(String, String)>, String, String) {
    let text = tok.decode(prompt).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let demos = lines[..lines.len() - 1]
        .iter()
        .map(|l| {
            let (x, y) = l.split_once(" -> ").unwrap();
            (x.to_string(), y.to_string())
        })
        .collect();
    let query = lines.last().unwrap().trim_end_matches(" ->").to_string();
    (demos, query, tok.decode(label).unwrap().trim().to_string())
}

#[test]
fn oracle_scorers_give_known_accuracy_and_margin() {
    let tok = Tokenizer::bytes();
    let opts = IclOptions { shots: 6, classes: 2, orders: 8, episodes: 3, queries: 7, ..Default::default() };
    // knows the rule (first letter a-m vs n-z) and reads the label words off the demonstrations
    let v = evaluate_icl(&tok, &opts, 100_000, &mut |p, l| {
        let (demos, q, label) = parse(&tok, p, l);
        let group = |s: &str| s.as_bytes()[0] < b'n';
        let right = demos.iter().find(|(x, _)| group(x) == group(&q)).map(|(_, y)| y.clone()).unwrap();
        Ok(if label == right { 0.0 } else { -1.0 })
    })
    .unwrap();
    assert_eq!(v["mean_accuracy"].as_f64().unwrap(), 1.0);
    assert_eq!(v["margin"].as_f64().unwrap(), 0.0);
    assert_eq!(v["chance_accuracy"].as_f64().unwrap(), 1.0 / opts.classes as f64);
    // recency bias: always the last demonstration's label -> accuracy depends on the order
    let v = evaluate_icl(&tok, &opts, 100_000, &mut |p, l| {
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

/// 24 labelled texts of 400 bytes each ("good ..." / "bad ..."), labels "pos" / "neg".
fn long_texts(dir: &Path) -> std::path::PathBuf {
    let mut lines = String::new();
    for i in 0..24 {
        let (word, label) = if i % 2 == 0 { ("good", "pos") } else { ("bad", "neg") };
        let mut t = String::new();
        while t.len() < 400 {
            t.push_str(&format!("{word} {i} "));
        }
        t.truncate(400);
        lines.push_str(&format!("{{\"text\": \"{t}\", \"label\": \"{label}\"}}\n"));
    }
    let p = dir.join("long.jsonl");
    std::fs::write(&p, lines).unwrap();
    p
}

#[test]
fn long_texts_are_truncated_to_fit_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let data = long_texts(dir.path());
    let tok = Tokenizer::bytes();
    let ctx = 256;
    // oracle: reads the (possibly truncated) query's first word; checks every prompt fits
    let mut oracle = |p: &[u32], l: &[u32]| -> anyhow::Result<f64> {
        if p.len() + l.len() - 1 > ctx {
            anyhow::bail!("prompt of {} tokens does not fit {ctx}", p.len());
        }
        let (demos, q, label) = parse(&tok, p, l);
        assert!(!demos.is_empty());
        let right = if q.starts_with("good") { "pos" } else { "neg" };
        Ok(if label == right { 0.0 } else { -1.0 })
    };
    // 4 shots: 4·(b + 8) + b + 6 <= 256 -> every text cut to b = 43 tokens, none dropped
    let opts =
        IclOptions { shots: 4, orders: 3, episodes: 2, queries: 4, data: Some(data.clone()), ..Default::default() };
    let v = evaluate_icl(&tok, &opts, ctx, &mut oracle).unwrap();
    assert_eq!(v["mean_accuracy"].as_f64().unwrap(), 1.0);
    assert_eq!(v["skipped_examples"].as_u64().unwrap(), 0);
    assert_eq!(v["truncated_examples"].as_u64().unwrap(), 2 * (4 + 4));
    for e in v["episodes"].as_array().unwrap() {
        assert_eq!(e["shots"].as_u64().unwrap(), 4);
        assert_eq!(e["text_budget"].as_u64().unwrap(), 43);
    }
    assert!(v["note"].as_str().unwrap().contains("43 tokens"), "{}", v["note"]);
    // 12 shots: the budget would fall below MIN_TEXT_TOKENS, so demonstrations are dropped until
    // 9 fit at b = 17 (10·b + 78 <= 256)
    assert_eq!(MIN_TEXT_TOKENS, 16);
    let opts =
        IclOptions { shots: 12, orders: 2, episodes: 2, queries: 4, data: Some(data.clone()), ..Default::default() };
    let v = evaluate_icl(&tok, &opts, ctx, &mut oracle).unwrap();
    assert_eq!(v["mean_accuracy"].as_f64().unwrap(), 1.0);
    assert_eq!(v["skipped_examples"].as_u64().unwrap(), 2 * 3);
    assert_eq!(v["truncated_examples"].as_u64().unwrap(), 2 * (9 + 4));
    assert_eq!(v["episodes"][0]["shots"].as_u64().unwrap(), 9);
    assert_eq!(v["episodes"][0]["text_budget"].as_u64().unwrap(), 17);
    // short texts that fit: nothing is changed
    let opts =
        IclOptions { shots: 2, orders: 2, episodes: 1, queries: 2, data: Some(data.clone()), ..Default::default() };
    let v = evaluate_icl(&tok, &opts, 100_000, &mut |_, _| Ok(0.0)).unwrap();
    assert_eq!(v["truncated_examples"].as_u64().unwrap(), 0);
    assert!(v["note"].is_null() && v["episodes"][0]["text_budget"].is_null());
    // not even one demonstration plus a query at 16 tokens each: (16 + 8) + 16 + 6 = 46 > 40
    let e = evaluate_icl(&tok, &opts, 40, &mut |_, _| Ok(0.0)).unwrap_err();
    assert!(e.to_string().contains("not even one demonstration"), "{e}");
}

#[test]
fn long_texts_run_on_a_256_token_model() {
    let dir = tempfile::tempdir().unwrap();
    let data = long_texts(dir.path());
    tiny_model_ctx(dir.path(), Family::DiffV1, 256);
    let opts = IclOptions { shots: 1, orders: 2, episodes: 1, queries: 2, data: Some(data), ..Default::default() };
    let v = run_icl(dir.path(), &opts, &dir.path().join("o")).unwrap();
    assert_eq!(v["truncated_examples"].as_u64().unwrap(), 3);
    assert_eq!(v["skipped_examples"].as_u64().unwrap(), 0);
    assert!(v["note"].is_string());
    let text = std::fs::read_to_string(dir.path().join("o/icl.json")).unwrap();
    let saved: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(saved["truncated_examples"], v["truncated_examples"]);
}
