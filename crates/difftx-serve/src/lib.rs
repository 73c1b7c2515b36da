//! difftx-serve: an OpenAI-compatible HTTP server for difftx runs and Hugging Face `DiffLlama` /
//! `Llama` folders, with continuous batching.
//!
//! ```text
//! HTTP (axum, tokio)                          decode thread (engine.rs)
//! POST /v1/completions ─┐  bounded queue   ┌─ join: prompt → first token
//! POST /v1/chat/...   ──┼─────────────────►│  step: every running request, one batched pass
//!        ▲ events       │                  └─ leave: stop / length / client gone
//!        └──────────────┴── per-request channel of text pieces, then Done or Failed
//! ```
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both stream as server-sent
//! events with `"stream": true`), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus).
//! With an API key, the `/v1` endpoints need `Authorization: Bearer KEY`. On SIGTERM or Ctrl-C the
//! server stops accepting connections, lets running requests finish for a grace period, cancels
//! what is left, and returns.

pub mod api;
pub mod chat;
pub mod engine;
pub mod metrics;

use anyhow::{Context, Result};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use chat::ChatTemplate;
use difftx_core::tokenizer::Tokenizer;
use engine::{Engine, EngineOptions, ServeWeights};
use metrics::Metrics;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Everything `difftx serve` can be told.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    /// 0: any free port (the bound address is in `Server::addr`).
    pub port: u16,
    pub weights: ServeWeights,
    /// How the fused decoder caches keys and values (bf16: half the bytes per position; needs
    /// f32, bf16 or int8 weights).
    pub kv_cache: difftx_core::KvPrecision,
    /// Requests decoded together at most.
    pub max_batch: usize,
    /// Drafts per pass of speculative decoding for a request running alone (a bf16 copy of the
    /// model drafts, the model checks them in one pass; the same text, greedy or sampled);
    /// `None`: off.
    pub speculative: Option<usize>,
    /// Requests waiting for a slot at most; beyond it requests get 503 with `Retry-After`.
    pub max_queue: usize,
    /// Largest `max_tokens` a request may ask for (default: the model's context).
    pub max_tokens: Option<usize>,
    pub api_key: Option<String>,
    /// After SIGTERM, how long running requests may go on before they are cancelled.
    pub shutdown_grace: Duration,
    /// The model's id in the API (default: the model folder's name).
    pub model_id: Option<String>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            host: "127.0.0.1".into(),
            port: 8080,
            weights: ServeWeights::Fused(difftx_core::WeightPrecision::F32),
            kv_cache: difftx_core::KvPrecision::F32,
            max_batch: 16,
            speculative: None,
            max_queue: 256,
            max_tokens: None,
            api_key: None,
            shutdown_grace: Duration::from_secs(10),
            model_id: None,
        }
    }
}

/// What every handler shares.
pub struct AppState {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    pub chat: ChatTemplate,
    pub metrics: Arc<Metrics>,
    pub model_id: String,
    pub vocab: usize,
    pub max_tokens: usize,
    pub max_queue: usize,
    pub api_key: Option<String>,
    pub started_unix: u64,
    pub next_id: AtomicU64,
    draining: AtomicBool,
}

impl AppState {
    /// Loads the model folder (a difftx run or model folder, or a Hugging Face folder) and starts
    /// the decode loop.
    pub fn load(model_dir: &Path, opts: &ServeOptions) -> Result<Self> {
        let dir = difftx_core::checkpoint::resolve_model_dir(model_dir)?;
        let model = difftx_core::checkpoint::load_runnable(&dir, &candle_core::Device::Cpu)?;
        let context = model.config().max_seq_len;
        let vocab = model.config().vocab_size;
        let tokenizer = Arc::new(Tokenizer::from_model_dir(&dir)?);
        let chat = ChatTemplate::from_model_dir(&dir)?;
        let max_tokens = opts.max_tokens.unwrap_or(context);
        anyhow::ensure!(max_tokens >= 1, "--max-tokens must be at least 1");
        anyhow::ensure!(opts.max_queue >= 1, "--max-queue must be at least 1");
        let metrics = Arc::new(Metrics::new()?);
        let engine_opts = EngineOptions {
            weights: opts.weights,
            kv_cache: opts.kv_cache,
            max_batch: opts.max_batch,
            max_queue: opts.max_queue,
            eos_token: eos_token(&dir),
            speculative: opts.speculative,
        };
        let engine = Engine::start(model, tokenizer.clone(), engine_opts, metrics.clone())?;
        let model_id = opts.model_id.clone().unwrap_or_else(|| folder_name(model_dir));
        Ok(AppState {
            engine,
            tokenizer,
            chat,
            metrics,
            model_id,
            vocab,
            max_tokens,
            max_queue: opts.max_queue,
            api_key: opts.api_key.clone(),
            started_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            next_id: AtomicU64::new(1),
            draining: AtomicBool::new(false),
        })
    }

    /// Whether the server is shutting down (new requests get 503).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// The name a folder is served under: its last component (a run's `checkpoint/` is skipped).
fn folder_name(dir: &Path) -> String {
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    canonical.file_name().map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned())
}

/// The end-of-sequence token of a Hugging Face folder (`eos_token_id` in generation_config.json
/// or config.json; the first one if it is a list). difftx runs have none.
fn eos_token(dir: &Path) -> Option<u32> {
    ["generation_config.json", "config.json"].iter().find_map(|f| {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join(f)).ok()?).ok()?;
        match &v["eos_token_id"] {
            serde_json::Value::Number(n) => n.as_u64().map(|n| n as u32),
            serde_json::Value::Array(a) => a.first()?.as_u64().map(|n| n as u32),
            _ => None,
        }
    })
}

/// The HTTP routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(api::completions))
        .route("/v1/chat/completions", post(api::chat_completions))
        .route("/v1/models", get(api::models))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(v1)
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics))
        .fallback(api::not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), count_requests))
        // A prompt can be at most the context long; 4 MiB is far above any context's text.
        .layer(axum::extract::DefaultBodyLimit::max(4 << 20))
        .with_state(state)
}

async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match api::authorized(&state, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

async fn count_requests(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let endpoint = match path {
        "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health" | "/metrics" => path.to_string(),
        _ => "other".to_string(),
    };
    let resp = next.run(req).await;
    state.metrics.requests.with_label_values(&[endpoint.as_str(), resp.status().as_str()]).inc();
    resp
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    state: Arc<AppState>,
    shutdown: tokio::sync::watch::Sender<bool>,
    grace: Duration,
    task: tokio::task::JoinHandle<Result<()>>,
}

impl Server {
    /// Loads the model, binds `opts.host:opts.port` and starts serving on the current tokio
    /// runtime.
    pub async fn start(model_dir: &Path, opts: ServeOptions) -> Result<Server> {
        let dir: PathBuf = model_dir.to_path_buf();
        let load_opts = opts.clone();
        let state = tokio::task::spawn_blocking(move || AppState::load(&dir, &load_opts))
            .await
            .context("the model loader stopped")??;
        let state = Arc::new(state);
        let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", opts.host, opts.port))?;
        let addr = listener.local_addr()?;
        // Streamed tokens are small writes: without TCP_NODELAY, Nagle's algorithm holds each
        // one until the client acknowledges the last (tens of ms with delayed ACKs).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let (shutdown, mut signal) = tokio::sync::watch::channel(false);
        let app = router(state.clone());
        let grace = opts.shutdown_grace;
        let drain_state = state.clone();
        let task = tokio::spawn(async move {
            let stopping = async move {
                let _ = signal.wait_for(|&s| s).await;
            };
            let server = axum::serve(listener, app).with_graceful_shutdown(async move {
                stopping.await;
                drain_state.draining.store(true, Ordering::SeqCst);
                // Running requests get the grace period, then are cancelled (their streams end
                // with an error event), so the connections close and the server returns.
                let st = drain_state.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    st.engine.cancel_all();
                });
            });
            server.await.context("the HTTP server failed")
        });
        Ok(Server { addr, state, shutdown, grace, task })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Stops accepting connections, lets running requests finish within the grace period
    /// (`ServeOptions::shutdown_grace`), cancels the rest, and waits for the server and the
    /// decode thread to end.
    pub async fn shutdown(self) -> Result<()> {
        let grace = self.grace;
        let _ = self.shutdown.send(true);
        // Past the grace period (plus time for cancelled streams to close) stop waiting.
        let result = match tokio::time::timeout(grace + Duration::from_secs(5), self.task).await {
            Ok(joined) => joined.context("the HTTP server task panicked")?,
            Err(_) => Ok(()),
        };
        let state = self.state;
        tokio::task::spawn_blocking(move || state.engine.shutdown()).await?;
        result
    }
}

/// `difftx serve`: serves until SIGTERM or Ctrl-C, then shuts down gracefully and returns.
pub fn run(model_dir: &Path, opts: ServeOptions) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let grace = opts.shutdown_grace;
        let server = Server::start(model_dir, opts.clone()).await?;
        let weights = match opts.weights {
            ServeWeights::Fused(p) => format!("{p:?}").to_lowercase(),
            ServeWeights::Quantized(f) => format!("{f:?}").to_lowercase(),
        };
        let st = server.state();
        let speculative = opts
            .speculative
            .map_or(String::new(), |k| format!(", speculative decoding of lone requests ({k} drafts per pass)"));
        eprintln!(
            "serving '{}' ({} weights, {} KV cache, context {} tokens, up to {} requests per step{}) on http://{}",
            st.model_id,
            weights,
            format!("{:?}", opts.kv_cache).to_lowercase(),
            st.engine.context(),
            opts.max_batch,
            speculative,
            server.addr()
        );
        eprintln!(
            "try: curl http://{}/v1/completions -d '{{\"prompt\": \"ROMEO:\", \"max_tokens\": 40}}'",
            server.addr()
        );
        wait_for_signal().await?;
        eprintln!("shutting down: no new requests; running ones get {} s", grace.as_secs_f64());
        server.shutdown().await?;
        eprintln!("stopped");
        Ok(())
    })
}

async fn wait_for_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r.context("cannot listen for Ctrl-C")?,
    }
    Ok(())
}
