//! The benchmark's smoke run: every part runs and reports sane numbers.

use difftx_train::bench::{run_bench, AttnRunner, BenchOptions};

#[test]
fn quick_bench_reports_every_part() {
    let opts = BenchOptions::quick(AttnRunner::InProcess);
    let r = run_bench(&opts).unwrap();
    for f in ["baseline", "diff-v1", "diff-v2"] {
        let tps = r["train"][f]["tokens_per_sec"].as_f64().unwrap();
        assert!(tps > 0.0 && tps.is_finite(), "{f}: {tps}");
        let loss = r["train"][f]["last_loss"].as_f64().unwrap();
        // Random tokens over a 256-byte vocabulary: the loss starts near ln 256 = 5.55.
        assert!(loss > 4.0 && loss < 7.0, "{f}: loss {loss}");
        assert_eq!(r["decode"][f]["new_tokens"].as_u64(), Some(opts.decode_tokens as u64));
        let tps = r["decode"][f]["tokens_per_sec"].as_f64().unwrap();
        assert!(tps > 0.0);
        // The figure is the median of the runs listed beside it.
        let mut runs: Vec<f64> =
            r["decode"][f]["tokens_per_sec_runs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        runs.sort_by(f64::total_cmp);
        assert_eq!(runs.len(), 5, "{f}");
        assert_eq!(runs[2], tps, "{f}: {runs:?}");
        // Its decoder alone ran too (the bench fails if it chose other tokens).
        assert!(r["decode"][f]["tokens_per_sec_alone"].as_f64().unwrap() > 0.0, "{f}");
        // Several sequences at once, at every cache precision timed, for every batch asked for.
        for key in [
            "batched_tokens_per_sec",
            "batched_tokens_per_sec_bf16_kv_cache",
            "batched_tokens_per_sec_bf16_weights_and_kv_cache",
            "batched_tokens_per_sec_bf16_weights_int8_kv_cache",
        ] {
            for b in &opts.decode_batches {
                let tps = r["decode"][f][key][b.to_string()].as_f64().unwrap_or(0.0);
                assert!(tps > 0.0 && tps.is_finite(), "{f} {key} {b}: {tps}");
            }
        }
        // Speculative decoding ran (it fails the bench if its tokens are not plain decoding's).
        let spec = &r["decode"][f]["speculative"];
        let acceptance = spec["acceptance"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acceptance), "{f}: {spec}");
        assert!(spec["tokens_per_sec"].as_f64().unwrap() > 0.0, "{f}: {spec}");
        assert_eq!(spec["tokens_per_sec_runs"].as_array().unwrap().len(), 5, "{f}: {spec}");
        // The fused kernels' attention time is a part of the step, forward and backward.
        let share = r["train"][f]["attention_kernels_share_of_step"].as_f64().unwrap();
        assert!(share > 0.0 && share < 1.0, "{f}: attention share {share}");
        for pass in ["forward", "backward"] {
            assert!(r["train"][f]["attention_kernels_ms_mean"][pass].as_f64().unwrap() > 0.0, "{f} {pass}");
        }
        let gflops = &r["train"][f]["model_gflops_per_sec"];
        for part in ["step", "attention_kernels", "outside_attention_kernels"] {
            assert!(gflops[part].as_f64().unwrap() > 0.0, "{f} {part}");
        }
    }
    // The host's matmul speed, before and after, on the training step's SwiGLU input product.
    let cfg = difftx_core::ModelConfig::preset(&opts.preset, difftx_core::Family::Baseline).unwrap();
    let shape: Vec<u64> =
        r["host_matmul"]["shape_m_k_n"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(shape, [(opts.batch_size * opts.seq_len) as u64, cfg.d_model as u64, cfg.d_ff as u64]);
    for when in ["gflops_before", "gflops_after"] {
        let g = r["host_matmul"][when].as_f64().unwrap();
        assert!(g > 0.0 && g.is_finite(), "{when}: {g}");
    }
    let reference = &r["train_reference_kernels"]["diff-v1"];
    assert!(reference["tokens_per_sec"].as_f64().unwrap() > 0.0);
    // Composed candle ops: no attention kernel ran, so no attention time is claimed.
    assert!(reference["attention_kernels_ms_mean"].is_null());
    assert!(r["ratios"]["train_step_time_diff-v1_over_baseline"].as_f64().unwrap() > 0.0);
    for f in ["diff-v1", "diff-v2"] {
        let flops = r["ratios"][format!("train_model_flops_{f}_over_baseline")].as_f64().unwrap();
        assert!(flops > 1.0 && flops < 1.5, "{f}: {flops}");
        // The rounds' own ratios: one per timed step, too few for an interval in a quick run.
        let paired = &r["ratios"][format!("train_step_time_{f}_over_baseline_paired")];
        assert_eq!(paired["rounds"].as_u64(), Some(opts.steps as u64), "{f}: {paired}");
        assert!(paired["median"].as_f64().unwrap() > 0.0, "{f}: {paired}");
        assert_eq!(opts.steps < 6, paired["ci95"].is_null(), "{f}: {paired}");
    }
    for f in ["baseline", "diff-v1"] {
        let rows = r["attn_long"][f].as_array().unwrap();
        assert_eq!(rows.len(), opts.attn_lengths.len());
        for (row, &n) in rows.iter().zip(&opts.attn_lengths) {
            assert_eq!(row["n"].as_u64(), Some(n as u64));
            assert!(row["peak_rss_mib"].as_f64().unwrap() >= row["rss_before_forward_mib"].as_f64().unwrap() - 1.0);
            assert!(row["mean_square_out"].as_f64().unwrap() > 0.0);
        }
    }
}

#[test]
fn rss_is_read_from_proc() {
    let (hwm, rss) = difftx_train::bench::rss_mib().unwrap();
    assert!(hwm >= rss && rss > 0.0, "{hwm} {rss}");
    // Touching 64 MiB raises the peak by about that much. `black_box`: an optimised build may
    // otherwise drop the buffer (only one byte of it is read, after the second reading) or fill
    // it after that reading; one build did, and the peak stayed put.
    let v = std::hint::black_box(vec![1u8; 64 << 20]);
    let (hwm2, _) = difftx_train::bench::rss_mib().unwrap();
    assert!(hwm2 >= hwm + 60.0 || hwm2 >= rss + 60.0, "{hwm} -> {hwm2}");
    assert_eq!(v[12345], 1);
}

/// Skipping training, decoding and attn-long together leaves nothing to time: an error that says
/// so, before any model is built, instead of a report with no figures.
#[test]
fn a_bench_with_every_part_skipped_is_refused() {
    let mut opts = BenchOptions::quick(AttnRunner::InProcess);
    opts.train = false;
    opts.decode_tokens = 0;
    opts.attn_lengths.clear();
    let err = run_bench(&opts).unwrap_err().to_string();
    assert!(err.contains("nothing to benchmark"), "{err}");
    // Any one part left on is a benchmark.
    opts.attn_lengths = vec![64];
    assert!(run_bench(&opts).is_ok());
}
