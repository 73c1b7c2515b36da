use difftx_core::Family;
use difftx_experiments::compare::*;

#[test]
fn quick_compare_writes_a_full_report() {
    let dir = tempfile::tempdir().unwrap();
    let opts = CompareOptions { quick: true, out: dir.path().join("cmp"), ..Default::default() };
    let t = std::time::Instant::now();
    let rep = run_compare(&opts).unwrap();
    eprintln!("quick compare wall time: {:.1} s", t.elapsed().as_secs_f64());
    let out = dir.path().join("cmp");
    for f in [
        "report.md",
        "report.json",
        "loss_curves.png",
        "needle_heatmaps.png",
        "recall.png",
        "attention_bars.png",
        "icl_spread.png",
    ] {
        assert!(out.join(f).metadata().map(|m| m.len() > 200).unwrap_or(false), "{f} missing");
    }
    // 3 families x 2 seeds, each analysed by every instrument
    let runs = rep.report_json["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 6);
    for r in runs {
        let dir = std::path::Path::new(r["dir"].as_str().unwrap());
        for f in ["needle.json", "recall.json", "attention.json", "icl.json", "outliers.json", "quantize.json"] {
            assert!(dir.join("analysis").join(f).exists(), "{f}");
        }
        let loss = r["results"]["train"]["final_val_loss"].as_f64().unwrap();
        // a byte model starts near ln(256) = 5.55 and must have learned something in 4 steps
        assert!(loss.is_finite() && loss < 5.55, "{loss}");
        let text_loss = r["results"]["train"]["text_loss"].as_f64().unwrap();
        assert!(text_loss.is_finite() && text_loss < 5.55, "{text_loss}");
        assert!(r["results"]["quantize"]["delta_by_setting"]["logits int4"].is_number());
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    for title in [
        "Validation loss",
        "Needle accuracy N=1, R=1",
        "Associative recall",
        "Attention allocated to the answer span",
        "Attention-sink share",
        "Best − worst accuracy",
        "Largest |attention logit|",
        "Loss increase with 4-bit attention logits",
        "Tokens to reach the baseline's final loss",
    ] {
        assert!(md.contains(title), "report lacks {title}");
    }
    assert!(md.contains("| diff-v1 |") && md.contains("| diff-v2 |") && md.contains("| baseline |"));
    // every verdict cell of the detail tables says one of the verdicts
    let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| diff-v")).collect();
    assert!(!rows.is_empty());
    for l in &rows {
        assert!(
            ["reproduced", "inconclusive", "uninformative", "not judged"].iter().any(|v| l.contains(v)),
            "no verdict in {l}"
        );
    }
    // four steps learn no retrieval: the accuracy claims are at the floor, hence uninformative
    let claims = rep.report_json["claims"].as_array().unwrap();
    let needle = claims.iter().find(|c| c["id"] == "needle_all").unwrap();
    let v1 = needle["arms"].as_array().unwrap().iter().find(|a| a["arm"] == "diff-v1").unwrap();
    assert_eq!(v1["verdict"], "uninformative", "{v1}");
    // raw masses are never judged
    let raw = claims.iter().find(|c| c["id"] == "attn_noise_mass").unwrap();
    assert!(raw["arms"].as_array().unwrap().iter().all(|a| a["verdict"].is_null()));
    let vl = claims.iter().find(|c| c["id"] == "val_loss").unwrap();
    let v1 = vl["arms"].as_array().unwrap().iter().find(|a| a["arm"] == "diff-v1").unwrap();
    assert_eq!(v1["values"].as_array().unwrap().len(), 2);
    // rerun reuses the finished runs
    let opts2 = CompareOptions {
        quick: true,
        out: dir.path().join("cmp"),
        arms: vec![Arm::of(Family::Baseline), Arm::of(Family::DiffV1)],
        ..Default::default()
    };
    let t2 = std::time::Instant::now();
    run_compare(&opts2).unwrap();
    assert!(t2.elapsed().as_secs_f64() < t.elapsed().as_secs_f64());
    assert!(out.join("mixture.json").exists());
    // a rerun with other settings refuses to mix runs
    let opts3 = CompareOptions { quick: true, lr: 1e-3, out: dir.path().join("cmp"), ..Default::default() };
    let e = run_compare(&opts3).unwrap_err();
    assert!(e.to_string().contains("different settings"), "{e}");
}

#[test]
fn sizes_and_the_ablation_arm_give_efficiency_and_ablation_rows() {
    let dir = tempfile::tempdir().unwrap();
    let arms: Vec<Arm> = ["baseline", "diff-v1", "diff-v1-nonorm"].iter().map(|a| a.parse().unwrap()).collect();
    let opts =
        CompareOptions { quick: true, out: dir.path().join("c"), arms, sizes: vec![48], jobs: 2, ..Default::default() };
    let rep = run_compare(&opts).unwrap();
    // 3 arms x 2 seeds x 2 widths
    assert_eq!(rep.report_json["runs"].as_array().unwrap().len(), 12);
    assert!(dir.path().join("c/runs/diff-v1-nonorm-d48-seed1/checkpoint").exists());
    assert!(dir.path().join("c/param_efficiency.png").exists());
    let md = std::fs::read_to_string(dir.path().join("c/report.md")).unwrap();
    assert!(md.contains("Parameters to match the baseline's loss"));
    assert!(md.contains("diff-v1 without its per-head norm"));
    let pe = rep.report_json["param_efficiency"].as_array().unwrap();
    assert_eq!(pe.len(), 2);
    assert!(!"diff-v1-nonorm".parse::<Arm>().unwrap().subln);
    assert!("diff-v3".parse::<Arm>().is_err());
}

#[test]
fn bad_budgets_and_families_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let e = run_compare(&CompareOptions { budget: Budget::Steps(1), out: dir.path().into(), ..Default::default() })
        .unwrap_err();
    assert!(e.to_string().contains("too small"), "{e}");
    let e = run_compare(&CompareOptions { budget: Budget::Seconds(1.0), out: dir.path().into(), ..Default::default() })
        .unwrap_err();
    assert!(e.to_string().contains("too small"), "{e}");
    let e = run_compare(&CompareOptions { arms: vec![], out: dir.path().into(), ..Default::default() }).unwrap_err();
    assert!(e.to_string().contains("no families"), "{e}");
    let e = run_compare(&CompareOptions { seeds: 0, out: dir.path().into(), ..Default::default() }).unwrap_err();
    assert!(e.to_string().contains("seeds"), "{e}");
    let e = run_compare(&CompareOptions {
        preset: "huge".into(),
        quick: true,
        out: dir.path().into(),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("huge"), "{e}");
}

#[test]
fn budgets_parse() {
    assert_eq!("300".parse::<Budget>().unwrap(), Budget::Steps(300));
    assert_eq!("40steps".parse::<Budget>().unwrap(), Budget::Steps(40));
    assert_eq!("90s".parse::<Budget>().unwrap(), Budget::Seconds(90.0));
    assert_eq!("15m".parse::<Budget>().unwrap(), Budget::Seconds(900.0));
    assert_eq!("1h".parse::<Budget>().unwrap(), Budget::Seconds(3600.0));
    for bad in ["", "x", "-3m", "1.5", "0m", "ten"] {
        assert!(bad.parse::<Budget>().is_err(), "{bad}");
    }
    // 15 s for 9 models, two at a time, is under 5 s each
    let dir = tempfile::tempdir().unwrap();
    let e =
        run_compare(&CompareOptions { budget: Budget::Seconds(15.0), out: dir.path().into(), ..Default::default() })
            .unwrap_err();
    assert!(e.to_string().contains("too small"), "{e}");
}

/// A compare run's training text is on disk and rebuilds exactly the token stream it trained on.
#[test]
fn compare_runs_record_their_exact_training_text() {
    use difftx_experiments::compare::{run_compare, CompareOptions};
    let tmp = tempfile::tempdir().unwrap();
    let opts = CompareOptions { quick: true, out: tmp.path().join("c"), ..Default::default() };
    run_compare(&opts).unwrap();
    let run = std::fs::read_dir(tmp.path().join("c/runs")).unwrap().next().unwrap().unwrap().path();
    let topts = difftx_train::trainer::read_options(&run).unwrap();
    assert_eq!(topts.data, tmp.path().join("c/mixture.jsonl"));
    assert_eq!(topts.windows, difftx_train::data::WindowStart::DocumentStart);
    let tok = difftx_core::tokenizer::Tokenizer::bytes();
    let texts = difftx_train::data::load_texts(&topts.data, "text").unwrap();
    let ds = difftx_train::data::TokenDataset::build(&texts, &tok, topts.seq_len, topts.val_fraction).unwrap();
    // Identical to the dataset compare built from the mixture documents themselves.
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("c/mixture.json")).unwrap()).unwrap();
    let spec: difftx_experiments::mixture::MixtureSpec = serde_json::from_value(m["spec"].clone()).unwrap();
    let corpus = difftx_experiments::mixture::read_corpus(None).unwrap();
    let docs = difftx_experiments::mixture::build_mixture(
        &spec,
        &corpus,
        m["windows"].as_u64().unwrap() as usize,
        m["seed"].as_u64().unwrap(),
    )
    .unwrap();
    let original = difftx_train::data::TokenDataset::build(&docs, &tok, topts.seq_len, topts.val_fraction).unwrap();
    assert!(original == ds, "the recorded training text gives a different token stream");
}

#[test]
fn the_text_loss_reads_the_real_text_documents_of_the_validation_split() {
    use difftx_experiments::compare::validation_text_documents;
    let docs: Vec<String> = ["aaaa", "b\nb", "cc", "dd"].iter().map(|s| s.to_string()).collect();
    // 14 characters with the separating newlines; the last 7 hold "cc" and "dd" whole.
    assert_eq!(validation_text_documents(&docs, 0.5), vec!["cc".to_string(), "dd".to_string()]);
    // Documents with a newline (needle, recall, in-context) are never real text.
    assert_eq!(validation_text_documents(&docs, 0.8), vec!["cc".to_string(), "dd".to_string()]);
    assert_eq!(validation_text_documents(&docs, 1.0), vec!["aaaa".to_string(), "cc".to_string(), "dd".to_string()]);
    assert_eq!(validation_text_documents(&docs, 0.1), vec!["dd".to_string()]);
    assert!(validation_text_documents(&docs, 0.05).is_empty());
}

#[test]
fn settings_differences_name_the_fields_and_ignore_float_parsing_noise() {
    let a = serde_json::json!({"lr": 0.003, "steps": 2400, "model": {"d_ff": 64, "init_std": 0.17677669529663687}});
    // one ulp off, as serde_json's default parser can read 1/√32 back
    let b = serde_json::json!({"lr": 0.003, "steps": 2400, "model": {"d_ff": 64, "init_std": 0.1767766952966369}});
    assert!(differing_fields(&a, &b, "").is_empty());
    let c = serde_json::json!({"lr": 0.004, "steps": 2401, "model": {"d_ff": 96, "init_std": 0.1767766952966369}});
    assert_eq!(
        differing_fields(&a, &c, ""),
        ["lr: 0.003 there, 0.004 now", "model.d_ff: 64 there, 96 now", "steps: 2400 there, 2401 now"]
    );
    // integers are compared exactly, however large
    let big = |n: u64| serde_json::json!({ "checkpoint_every": n });
    assert_eq!(differing_fields(&big(u64::MAX), &big(u64::MAX - 1), "").len(), 1);
    // a field only one side has
    assert_eq!(differing_fields(&serde_json::json!({"x": 1}), &serde_json::json!({}), ""), ["x: 1 there, null now"]);
}
