//! A bounded load test of `difftx serve` on loopback: starts the server in this process, sends a
//! fixed number of streaming completions at each concurrency level, and prints JSON: requests
//! that failed, aggregate generated tokens per second, and time to first token (p50, p99).
//! Stops by itself after the requests or the time limit, whichever comes first.
//!
//! ```text
//! cargo run --release -p difftx-serve --example load_test -- --concurrency 1,8,64
//! ```
//!
//! Without `--model` it serves a random-weight `bench-s` diff-v1 model (throughput does not
//! depend on the weights' values). Client and server share the machine's cores.

use candle_core::{DType, Device};
use clap::Parser;
use difftx_core::{checkpoint, model::init_weights, Family, KvPrecision, ModelConfig};
use difftx_serve::engine::ServeWeights;
use difftx_serve::{ServeOptions, Server};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Model folder [default: a random-weight bench-s diff-v1 model].
    #[arg(long)]
    model: Option<PathBuf>,
    /// Concurrent clients of each round, comma-separated.
    #[arg(long, default_value = "1,8,64", value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Requests per round (at least the round's concurrency is sent).
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Requests of the single-client round (a single client is slow; it needs fewer).
    #[arg(long, default_value_t = 8)]
    single_requests: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Prompt length in tokens (bytes).
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// Requests decoded together at most.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// f32, bf16, int8, q8_0 or q4k.
    #[arg(long, default_value = "f32")]
    weights: ServeWeights,
    /// KV cache of the fused decoder: f32, bf16 or int8.
    #[arg(long, default_value = "f32")]
    kv_cache: KvPrecision,
    /// Sampling temperature of every request (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Speculative decoding of a request running alone, drafts per pass (as `difftx serve
    /// --speculative`): applies in the single-client round, and whenever one request is left.
    #[arg(long)]
    speculative: Option<usize>,
    /// Seconds after which no new request is sent (the running ones finish).
    #[arg(long, default_value_t = 300.0)]
    time_limit: f64,
}

/// One request's outcome: (time to first token, completion tokens) or an error.
type Outcome = Result<(Duration, usize), String>;

async fn one_request(http: &reqwest::Client, url: &str, body: &Value) -> Outcome {
    let started = Instant::now();
    let r = http.post(url).json(body).send().await.map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("status {}: {}", r.status(), r.text().await.unwrap_or_default()));
    }
    let mut first = None;
    let mut tokens = None;
    let mut buf = String::new();
    let mut stream = r.bytes_stream();
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.map_err(|e| e.to_string())?));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
            if v.get("error").is_some() {
                return Err(v["error"]["message"].to_string());
            }
            if first.is_none() && v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                first = Some(started.elapsed());
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n as usize);
            }
        }
    }
    match (first, tokens) {
        (Some(f), Some(n)) => Ok((f, n)),
        _ => Err("the stream ended without text or usage".into()),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tmp = tempfile::tempdir()?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => {
            let cfg = ModelConfig::preset("bench-s", Family::DiffV1)?;
            let dir = tmp.path().join("bench-s-diff-v1");
            checkpoint::save_model(&dir, &cfg, &init_weights(&cfg, 0, DType::F32, &Device::Cpu)?)?;
            dir
        }
    };
    let max_queue = args.requests.max(*args.concurrency.iter().max().unwrap_or(&1)) + 1;
    let opts = ServeOptions {
        port: 0,
        max_batch: args.max_batch,
        max_queue,
        weights: args.weights,
        kv_cache: args.kv_cache,
        speculative: args.speculative,
        ..ServeOptions::default()
    };
    let server = Server::start(&dir, opts).await?;
    let url = format!("http://{}/v1/completions", server.addr());
    let http = reqwest::Client::builder().pool_max_idle_per_host(256).build()?;
    let deadline = Instant::now() + Duration::from_secs_f64(args.time_limit);
    let prompt: String =
        "The quick brown fox jumps over the lazy dog. ".chars().cycle().take(args.prompt_tokens).collect();
    let mut rounds = Vec::new();
    for &clients in &args.concurrency {
        let total = if clients == 1 { args.single_requests } else { args.requests.max(clients) };
        eprintln!("{clients} concurrent clients, {total} requests of {} tokens ...", args.max_tokens);
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let started = Instant::now();
        let workers: Vec<_> = (0..clients)
            .map(|_| {
                let (http, url, next, prompt) = (http.clone(), url.clone(), next.clone(), prompt.clone());
                let (max_tokens, temperature) = (args.max_tokens, args.temperature);
                tokio::spawn(async move {
                    let mut outcomes = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        if i >= total || Instant::now() > deadline {
                            return outcomes;
                        }
                        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                                          "seed": i, "stream": true, "stream_options": {"include_usage": true}});
                        outcomes.push(one_request(&http, &url, &body).await);
                    }
                })
            })
            .collect();
        let mut outcomes: Vec<Outcome> = Vec::new();
        for w in workers {
            outcomes.extend(w.await?);
        }
        let wall = started.elapsed().as_secs_f64();
        let failed: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
        let mut ttft: Vec<f64> =
            outcomes.iter().filter_map(|o| o.as_ref().ok()).map(|(t, _)| t.as_secs_f64()).collect();
        ttft.sort_by(f64::total_cmp);
        let tokens: usize = outcomes.iter().filter_map(|o| o.as_ref().ok()).map(|(_, n)| n).sum();
        let round = json!({
            "clients": clients,
            "requests": outcomes.len(),
            "failed": failed.len(),
            "first_failure": failed.first(),
            "generated_tokens": tokens,
            "wall_seconds": wall,
            "tokens_per_sec": tokens as f64 / wall,
            "ttft_p50_ms": 1e3 * percentile(&ttft, 50.0),
            "ttft_p99_ms": 1e3 * percentile(&ttft, 99.0),
            "stopped_by_time_limit": outcomes.len() < total,
        });
        eprintln!("  {round}");
        rounds.push(round);
    }
    let single = rounds.iter().find(|r| r["clients"] == 1).and_then(|r| r["tokens_per_sec"].as_f64());
    let eight = rounds.iter().find(|r| r["clients"] == 8).and_then(|r| r["tokens_per_sec"].as_f64());
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
    });
    // The server's own count of drafts kept over all rounds (`/metrics`).
    let metrics = http.get(format!("http://{}/metrics", server.addr())).send().await?.text().await?;
    let counter =
        |name: &str| metrics.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok()).unwrap_or(0.0);
    let drafted = counter("difftx_speculative_drafted_tokens_total");
    let accepted = counter("difftx_speculative_accepted_tokens_total");
    let report = json!({
        "model": if args.model.is_some() { dir.display().to_string() } else { "random bench-s diff-v1".into() },
        "weights": format!("{:?}", args.weights),
        "kv_cache": format!("{:?}", args.kv_cache),
        "max_batch": args.max_batch,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "speculative": args.speculative,
        "speculative_drafted_tokens": drafted,
        "speculative_acceptance": if drafted > 0.0 { json!(accepted / drafted) } else { Value::Null },
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "rounds": rounds,
        "speedup_8_clients_over_1": match (single, eight) { (Some(a), Some(b)) => json!(b / a), _ => Value::Null },
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    server.shutdown().await?;
    Ok(())
}
