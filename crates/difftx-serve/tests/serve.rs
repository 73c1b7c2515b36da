//! The real server on a loopback port, spoken to over HTTP: completions, chat, streaming,
//! continuous batching with per-request seeds, every error case, disconnects, metrics and
//! graceful shutdown. Models are small random-weight models (their text is noise, but it is
//! deterministic, which is what these tests check).

use candle_core::{DType, Device};
use difftx_core::{checkpoint, model::init_weights, Family, KvPrecision, ModelConfig};
use difftx_serve::engine::ServeWeights;
use difftx_serve::{ServeOptions, Server};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A random-weight model folder (`nano`-sized, context `ctx`).
fn model_dir(root: &Path, family: Family, ctx: usize) -> PathBuf {
    let mut cfg = ModelConfig::preset("nano", family).unwrap();
    cfg.max_seq_len = ctx;
    let dir = root.join(format!("{family:?}-{ctx}"));
    let weights = init_weights(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
    checkpoint::save_model(&dir, &cfg, &weights).unwrap();
    dir
}

fn opts() -> ServeOptions {
    ServeOptions { port: 0, shutdown_grace: Duration::from_secs(5), ..ServeOptions::default() }
}

struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    fn new(server: &Server) -> Self {
        Client { http: reqwest::Client::new(), base: format!("http://{}", server.addr()) }
    }
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }
    async fn post_raw(&self, path: &str, body: &'static str) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).body(body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }
    async fn get_text(&self, path: &str) -> (u16, String) {
        let r = self.http.get(format!("{}{path}", self.base)).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }
    /// Waits until `n` requests are in the running batch.
    async fn wait_running(&self, n: usize) {
        for _ in 0..500 {
            if metric(&self.get_text("/metrics").await.1, "difftx_running_requests") == n as f64 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("{n} requests never ran together");
    }
    /// A streamed request's `data:` payloads in order (the last one is `[DONE]`).
    async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let r = self.http.post(format!("{}{path}", self.base)).json(&body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        let mut buf = String::new();
        let mut bytes = r.bytes_stream();
        while let Some(chunk) = bytes.next().await {
            buf.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
        buf.split("\n\n")
            .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ")).map(str::to_string))
            .collect()
    }
}

fn text_of(v: &Value) -> String {
    let c = &v["choices"][0];
    c["text"].as_str().or(c["message"]["content"].as_str()).unwrap().to_string()
}

/// Sends each request alone, then all of them at once: every one answers 200 and, in the batch,
/// the text it gave alone. Returns the server's metrics after.
async fn alone_then_together(c: &Client, reqs: &[Value]) -> String {
    let mut alone = Vec::new();
    for r in reqs {
        let (status, v) = c.post("/v1/completions", r.clone()).await;
        assert_eq!(status, 200, "{v}");
        alone.push(text_of(&v));
    }
    let together = futures_util::future::join_all(reqs.iter().map(|r| c.post("/v1/completions", r.clone()))).await;
    for (i, (status, v)) in together.iter().enumerate() {
        assert_eq!(*status, 200, "{v}");
        assert_eq!(text_of(v), alone[i], "request {i} differs in a batch");
    }
    let (_, m) = c.get_text("/metrics").await;
    // Some steps ran more than one request.
    let one = m.lines().find_map(|l| l.strip_prefix("difftx_batch_size_bucket{le=\"1\"} ")).unwrap();
    assert!(one.trim().parse::<f64>().unwrap() < metric(&m, "difftx_batch_size_count"), "no step ran two:\n{m}");
    m
}

/// The value of an unlabelled metric in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vocabulary_larger_than_the_tokenizers_draws_only_its_ids_alone_or_batched() {
    // 32,000 ids and the byte tokenizer's 256: random weights make the extra ids the likely ones,
    // which the server drew (and failed to decode) before its samplers were limited. Batched, two
    // or more such rows split their draws over the decode team: each request's text must be its
    // text alone.
    let root = tempfile::tempdir().unwrap();
    let mut cfg = ModelConfig::preset("nano", Family::DiffV1).unwrap();
    cfg.vocab_size = 32_000;
    let dir = root.path().join("wide");
    checkpoint::save_model(&dir, &cfg, &init_weights(&cfg, 7, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let server = Server::start(&dir, opts()).await.unwrap();
    let c = Client::new(&server);
    let reqs: Vec<Value> = (0..4)
        .map(|i| {
            json!({"prompt": format!("Request {i}"), "max_tokens": 40, "seed": i,
                   "temperature": if i == 0 { 0.0 } else { 1.0 }, "top_p": if i == 3 { 0.9 } else { 1.0 }})
        })
        .collect();
    let m = alone_then_together(&c, &reqs).await;
    assert_eq!(metric(&m, "difftx_generated_tokens_total"), 8.0 * 40.0, "{m}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_chat_and_streams_agree() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV1, 256);
    let server = Server::start(&dir, opts()).await.unwrap();
    let c = Client::new(&server);

    // A whole completion: OpenAI's shape and usage.
    let req = json!({"prompt": "ROMEO:", "max_tokens": 20, "temperature": 0.9, "seed": 5});
    let (status, v) = c.post("/v1/completions", req.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 6);
    assert_eq!(v["usage"]["completion_tokens"], 20);
    assert_eq!(v["usage"]["total_tokens"], 26);
    let whole = text_of(&v);
    assert!(!whole.is_empty());
    // The same seed again gives the same text; another seed another text.
    assert_eq!(text_of(&c.post("/v1/completions", req.clone()).await.1), whole);
    let other = c.post("/v1/completions", json!({"prompt": "ROMEO:", "max_tokens": 20, "seed": 6})).await.1;
    assert_ne!(text_of(&other), whole);

    // Streamed: the chunks reassemble to the same text, then one finish chunk, then [DONE].
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let events = c.stream("/v1/completions", sreq).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, whole);
    let finish: Vec<&Value> = chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 20);

    // Chat: the plain template, whole and streamed.
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                      "max_tokens": 15, "seed": 3, "temperature": 0.7});
    let (status, v) = c.post("/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let prompt = "System: Be brief.\nUser: Hello\nAssistant:";
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    let chat_text = text_of(&v);
    assert!(!chat_text.contains("\nUser:"), "the plain template's stop string must end the answer");
    let mut schat = chat.clone();
    schat["stream"] = json!(true);
    let events = c.stream("/v1/chat/completions", schat).await;
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, chat_text);

    // A stop string: the text ends just before its first occurrence, finish_reason "stop".
    let long = text_of(&c.post("/v1/completions", json!({"prompt": "ROMEO:", "max_tokens": 60, "seed": 9})).await.1);
    let chars: Vec<char> = long.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let expected = &long[..long.find(&stop).unwrap()];
    let (_, v) =
        c.post("/v1/completions", json!({"prompt": "ROMEO:", "max_tokens": 60, "seed": 9, "stop": [stop]})).await;
    assert_eq!(text_of(&v), expected);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Token ids as the prompt, models, health.
    let (status, v) = c
        .post(
            "/v1/completions",
            json!({"prompt": [82, 79, 77, 69, 79, 58], "max_tokens": 20, "temperature": 0.9, "seed": 5}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(text_of(&v), whole);
    let (status, models) = c.get_text("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "DiffV1-256");
    let (status, health) = c.get_text("/health").await;
    assert_eq!((status, health.contains("ok")), (200, true));

    // Metrics count what happened.
    let (status, m) = c.get_text("/metrics").await;
    assert_eq!(status, 200);
    assert!(metric(&m, "difftx_generated_tokens_total") >= 100.0);
    assert!(m.contains("difftx_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"));
    assert!(m.contains("difftx_time_to_first_token_seconds_count"));
    assert!(m.contains("difftx_time_per_output_token_seconds_bucket"));
    assert!(m.contains("difftx_batch_size_bucket"));
    assert_eq!(metric(&m, "difftx_queue_depth"), 0.0);
    server.shutdown().await.unwrap();
}

/// Requests that run together give each the text it gets alone (its own seed and sampling).
async fn batched_equals_alone(weights: ServeWeights, kv_cache: KvPrecision, speculative: Option<usize>) {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV2, 256);
    let server =
        Server::start(&dir, ServeOptions { weights, kv_cache, max_batch: 8, speculative, ..opts() }).await.unwrap();
    let c = Client::new(&server);
    let reqs: Vec<Value> = (0..8)
        .map(|i| {
            json!({"prompt": format!("Request {i} says"), "max_tokens": 120 + 3 * i, "seed": 100 + i,
                   "temperature": if i % 3 == 0 { 0.0 } else { 0.8 }, "top_p": if i % 2 == 0 { 1.0 } else { 0.9 }})
        })
        .collect();
    let m = alone_then_together(&c, &reqs).await;
    // Requests alone ran speculative passes (only then).
    let drafted = metric(&m, "difftx_speculative_drafted_tokens_total");
    assert_eq!(drafted > 0.0, speculative.is_some(), "{m}");
    assert!(metric(&m, "difftx_speculative_accepted_tokens_total") <= drafted, "{m}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_request_gives_the_same_text_alone_or_in_a_batch() {
    batched_equals_alone(ServeWeights::Fused(difftx_core::WeightPrecision::F32), KvPrecision::F32, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bf16_kv_cache_serves_and_batches_the_same() {
    batched_equals_alone(ServeWeights::Fused(difftx_core::WeightPrecision::Bf16), KvPrecision::Bf16, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_int8_kv_cache_serves_and_batches_the_same() {
    batched_equals_alone(ServeWeights::Fused(difftx_core::WeightPrecision::F32), KvPrecision::Int8, None).await;
}

/// A speculative pass checks its drafts in one pass over the int8 cache, each row reading the
/// rows before it as codes: the same text as single steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_passes_over_an_int8_kv_cache_serve_the_same_text() {
    batched_equals_alone(ServeWeights::Fused(difftx_core::WeightPrecision::F32), KvPrecision::Int8, Some(4)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_passes_serve_the_same_text_alone_or_in_a_batch() {
    batched_equals_alone(ServeWeights::Fused(difftx_core::WeightPrecision::F32), KvPrecision::F32, Some(4)).await;
}

/// Requests served by speculative passes, greedy or sampled, get the text, finish reason and
/// token count that single steps give: limits and stop strings in the middle of a pass, a full
/// context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decoding_gives_the_text_of_single_steps() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV1, 64);
    let plain = Server::start(&dir, opts()).await.unwrap();
    let fast = Server::start(&dir, ServeOptions { speculative: Some(5), ..opts() }).await.unwrap();
    let (cp, cf) = (Client::new(&plain), Client::new(&fast));
    let long = "a".repeat(50);
    let mut reqs = vec![
        json!({"prompt": "Once", "max_tokens": 40, "temperature": 0.0}),
        json!({"prompt": "Once", "max_tokens": 7, "temperature": 0.0}),
        json!({"prompt": "Once", "max_tokens": 1, "temperature": 0.0}),
        json!({"prompt": long, "max_tokens": 64, "temperature": 0.0}),
        json!({"prompt": "Once", "max_tokens": 40, "temperature": 0.9, "seed": 3}),
        json!({"prompt": "Once", "max_tokens": 33, "temperature": 1.2, "top_p": 0.9, "seed": 4}),
    ];
    // A stop string from the middle of the plain text.
    let text = text_of(&cp.post("/v1/completions", reqs[0].clone()).await.1);
    let stop: String = text.chars().skip(9).take(2).collect();
    reqs.push(json!({"prompt": "Once", "max_tokens": 40, "temperature": 0.0, "stop": [stop]}));
    for req in &reqs {
        let (sp, vp) = cp.post("/v1/completions", req.clone()).await;
        let (sf, vf) = cf.post("/v1/completions", req.clone()).await;
        assert_eq!((sp, sf), (200, 200), "{vp} {vf}");
        assert_eq!(text_of(&vf), text_of(&vp), "{req}");
        assert_eq!(vf["choices"][0]["finish_reason"], vp["choices"][0]["finish_reason"], "{req}");
        assert_eq!(vf["usage"], vp["usage"], "{req}");
    }
    let streamed = cf
        .stream(
            "/v1/completions",
            json!({"prompt": "Once", "max_tokens": 40, "temperature": 0.0,
                                                        "stream": true}),
        )
        .await;
    let pieces: String = streamed
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(pieces, text);
    let (_, m) = cf.get_text("/metrics").await;
    assert!(metric(&m, "difftx_speculative_drafted_tokens_total") > 0.0, "{m}");
    assert!(metric(&m, "difftx_speculative_accepted_tokens_total") > 0.0, "{m}");
    let (_, m) = cp.get_text("/metrics").await;
    assert_eq!(metric(&m, "difftx_speculative_drafted_tokens_total"), 0.0, "{m}");
    plain.shutdown().await.unwrap();
    fast.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decoding_with_ggml_weights_or_no_drafts_is_refused_at_start() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV1, 64);
    let weights = ServeWeights::Quantized(difftx_core::WeightFormat::Q4K);
    let start = Server::start(&dir, ServeOptions { weights, speculative: Some(4), ..opts() }).await;
    let err = format!("{:#}", start.err().expect("q4k weights with --speculative started"));
    assert!(err.contains("--speculative runs the fused decoder"), "{err}");
    let start = Server::start(&dir, ServeOptions { speculative: Some(0), ..opts() }).await;
    let err = format!("{:#}", start.err().expect("--speculative 0 started"));
    assert!(err.contains("at least 1"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reduced_kv_cache_with_ggml_weights_is_refused_at_start() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV1, 64);
    let weights = ServeWeights::Quantized(difftx_core::WeightFormat::Q8_0);
    for (kv_cache, name) in [(KvPrecision::Bf16, "bf16"), (KvPrecision::Int8, "int8")] {
        let start = Server::start(&dir, ServeOptions { weights, kv_cache, ..opts() }).await;
        let err = format!("{:#}", start.err().expect("q8_0 weights with a reduced KV cache started"));
        assert!(err.contains(&format!("--kv-cache {name}")), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantised_weights_serve_and_batch_the_same() {
    batched_equals_alone(ServeWeights::Quantized(difftx_core::WeightFormat::Q8_0), KvPrecision::F32, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_with_the_right_status() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::Baseline, 64);
    let server = Server::start(&dir, ServeOptions { max_tokens: Some(32), ..opts() }).await.unwrap();
    let c = Client::new(&server);
    let check = |status: u16, v: &Value, want: u16, code: &str| {
        assert_eq!(status, want, "{v}");
        assert_eq!(v["error"]["code"], code, "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert!(v["error"]["type"].is_string());
    };
    let (s, v) = c.post_raw("/v1/completions", "{\"prompt\": \"hi\", ").await;
    check(s, &v, 400, "invalid_json");
    let (s, v) = c.post_raw("/v1/completions", "not json at all").await;
    check(s, &v, 400, "invalid_json");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "max_tokens": "ten"})).await;
    check(s, &v, 422, "invalid_type");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "temperature": [1]})).await;
    check(s, &v, 422, "invalid_type");
    let (s, v) = c.post("/v1/completions", json!({"max_tokens": 3})).await;
    check(s, &v, 422, "invalid_type");
    let (s, v) = c.post("/v1/chat/completions", json!({"messages": "hello"})).await;
    check(s, &v, 422, "invalid_type");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "x".repeat(65)})).await;
    check(s, &v, 413, "context_length_exceeded");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 33})).await;
    check(s, &v, 422, "invalid_value");
    assert_eq!(v["error"]["param"], "max_tokens");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 0})).await;
    check(s, &v, 422, "invalid_value");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "n": 2})).await;
    check(s, &v, 422, "invalid_value");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "temperature": -1})).await;
    check(s, &v, 422, "invalid_value");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "top_p": 0})).await;
    check(s, &v, 422, "invalid_value");
    let (s, v) = c.post("/v1/completions", json!({"prompt": ""})).await;
    check(s, &v, 422, "invalid_value");
    let (s, v) = c.post("/v1/completions", json!({"prompt": [1, 2, 999]})).await;
    check(s, &v, 422, "invalid_value");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]})).await;
    check(s, &v, 422, "invalid_value");
    let (s, v) = c.post("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "hi"}]})).await;
    check(s, &v, 422, "invalid_value");
    let (s, v) = c.post("/v1/completions", json!({"prompt": "hi", "model": "gpt-4"})).await;
    check(s, &v, 404, "model_not_found");
    let (s, v) = c.post("/v1/nothing", json!({})).await;
    check(s, &v, 404, "unknown_route");
    // Unknown fields are ignored, as OpenAI's clients send many.
    let (s, v) =
        c.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2, "user": "me", "frequency_penalty": 0})).await;
    assert_eq!(s, 200, "{v}");
    // The server still serves after all of that.
    let (_, m) = c.get_text("/metrics").await;
    assert!(m.contains("status=\"422\""));
    // A body above the limit (4 MiB), on a connection of its own: the server answers before
    // reading it all and closes that connection.
    let big = "x".repeat(5 << 20);
    let r = reqwest::Client::new().post(format!("{}/v1/completions", c.base)).body(big).send().await.unwrap();
    let status = r.status().as_u16();
    check(status, &r.json().await.unwrap(), 413, "request_too_large");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_required_when_set() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV1, 64);
    let server = Server::start(&dir, ServeOptions { api_key: Some("s3cret".into()), ..opts() }).await.unwrap();
    let c = Client::new(&server);
    let body = json!({"prompt": "hi", "max_tokens": 2});
    for auth in [None, Some("Bearer wrong"), Some("s3cret"), Some("Bearer s3cre")] {
        let mut r = c.http.post(format!("{}/v1/completions", c.base)).json(&body);
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{auth:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let r = c.http.get(format!("{}/v1/models", c.base)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = c.http.post(format!("{}/v1/completions", c.base)).bearer_auth("s3cret").json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(c.get_text("/health").await.0, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_with_retry_after_and_the_others_finish() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV1, 2048);
    let server = Server::start(&dir, ServeOptions { max_batch: 1, max_queue: 1, ..opts() }).await.unwrap();
    let c = Client::new(&server);
    let body = json!({"prompt": "a", "max_tokens": 1500, "seed": 1});
    let sends = (0..6).map(|_| c.http.post(format!("{}/v1/completions", c.base)).json(&body).send());
    let answers = futures_util::future::join_all(sends).await;
    let mut busy = 0;
    for r in answers {
        let r = r.unwrap();
        match r.status().as_u16() {
            200 => assert_eq!(r.json::<Value>().await.unwrap()["usage"]["completion_tokens"], 1500),
            503 => {
                busy += 1;
                assert_eq!(r.headers()["retry-after"], "1");
                assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "queue_full");
            }
            s => panic!("unexpected status {s}"),
        }
    }
    // One runs, one waits, the others are turned away.
    assert!(busy >= 3, "{busy} requests got 503");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_frees_its_slot() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV1, 2048);
    let server = Server::start(&dir, ServeOptions { max_batch: 1, ..opts() }).await.unwrap();
    let c = Client::new(&server);
    let body = json!({"prompt": "a", "max_tokens": 2000, "stream": true});
    let r = c.http.post(format!("{}/v1/completions", c.base)).json(&body).send().await.unwrap();
    let mut stream = r.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    // The slot is free long before 2,000 tokens: the next request runs at once.
    let (status, v) = c.post("/v1/completions", json!({"prompt": "b", "max_tokens": 5})).await;
    assert_eq!(status, 200, "{v}");
    c.wait_running(0).await;
    let (_, m) = c.get_text("/metrics").await;
    let generated = metric(&m, "difftx_generated_tokens_total");
    assert!(generated < 1000.0, "the dropped stream went on generating: {generated} tokens");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_running_requests_then_refuses_and_cancels_after_the_grace() {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), Family::DiffV1, 1024);
    // Within the grace period a running request finishes.
    let server = Server::start(&dir, ServeOptions { shutdown_grace: Duration::from_secs(30), ..opts() }).await.unwrap();
    let c = Client::new(&server);
    let running = tokio::spawn({
        let (http, base) = (c.http.clone(), c.base.clone());
        async move {
            let r = http.post(format!("{base}/v1/completions")).json(&json!({"prompt": "a", "max_tokens": 400})).send();
            let v: Value = r.await.unwrap().json().await.unwrap();
            v
        }
    });
    c.wait_running(1).await;
    server.shutdown().await.unwrap();
    let v = running.await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 400, "{v}");
    // The port is closed afterwards.
    assert!(c.http.get(format!("{}/health", c.base)).send().await.is_err());

    // Past the grace period a running stream is cancelled with an error event and [DONE].
    let dir = model_dir(root.path(), Family::DiffV1, 8192);
    let server = Server::start(&dir, ServeOptions { shutdown_grace: Duration::ZERO, ..opts() }).await.unwrap();
    let c = Client::new(&server);
    let r = c
        .http
        .post(format!("{}/v1/completions", c.base))
        .json(&json!({"prompt": "a", "max_tokens": 8000, "stream": true}))
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(async move {
        let mut all = String::new();
        let mut s = r.bytes_stream();
        while let Some(Ok(b)) = s.next().await {
            all.push_str(&String::from_utf8_lossy(&b));
        }
        all
    });
    c.wait_running(1).await;
    let started = std::time::Instant::now();
    server.shutdown().await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    let all = reader.await.unwrap();
    assert!(all.contains("shutting_down"), "{}", &all[all.len().saturating_sub(400)..]);
    assert!(all.trim_end().ends_with("data: [DONE]"));
}
