//! The OpenAI-compatible HTTP API: request and response shapes, errors, handlers.

use crate::chat::Message;
use crate::engine::{Event, FinishReason, Job, SubmitError, Usage};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use difftx_core::generate::SamplingParams;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub code: &'static str,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), code, param: None }
    }
    fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param), ..ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_value", message) }
    }
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "server_busy_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }
    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Parses a JSON body whatever its content type (`curl -d` sends a form type): bad JSON is 400,
/// well-formed JSON with a missing field or a field of the wrong type is 422, too big is 413.
fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| {
        let status = e.status();
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE { "request_too_large" } else { "invalid_body" };
        ApiError::new(status, code, format!("cannot read the request body: {}", e.body_text()))
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_type", format!("invalid request: {e}"))
            }
            _ => ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", format!("the body is not valid JSON: {e}")),
        }
    })
}

/// `prompt`: one string, a list holding one string, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

/// `stop`: one string or a list of up to 4.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and length fields shared by both endpoints. Fields OpenAI defines that difftx does
/// not use (`user`, `logit_bias`, penalties, ...) are accepted and ignored.
#[derive(Debug, Default, Deserialize)]
pub struct Generation {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Not in OpenAI's API; as in vLLM.
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<StopInput>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    #[serde(flatten)]
    pub gen: Generation,
}

/// Message content: a string, or a list of parts of which the text parts are used.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    pub gen: Generation,
}

/// Which endpoint shapes the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Checks the request's generation fields and makes the engine's job (without its channel).
struct Prepared {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingParams,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
}

fn prepare(
    state: &AppState,
    gen: &Generation,
    prompt: Vec<u32>,
    default_max: usize,
    extra_stop: Vec<String>,
) -> Result<Prepared, ApiError> {
    if let Some(m) = &gen.model {
        if m != &state.model_id {
            return Err(ApiError {
                param: Some("model"),
                ..ApiError::new(
                    StatusCode::NOT_FOUND,
                    "model_not_found",
                    format!("model '{m}' is not served here; this server serves '{}'", state.model_id),
                )
            });
        }
    }
    if let Some(n) = gen.n {
        if n != 1 {
            return Err(ApiError::invalid("n", format!("n must be 1 (one choice per request), got {n}")));
        }
    }
    let context = state.engine.context();
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty: give at least one token of text"));
    }
    if prompt.len() > context {
        return Err(ApiError {
            param: Some("prompt"),
            ..ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "context_length_exceeded",
                format!("the prompt is {} tokens long; this model's context is {context} tokens", prompt.len()),
            )
        });
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= state.vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("token {bad} is outside the vocabulary of {} tokens", state.vocab),
        ));
    }
    let max_tokens = match gen.max_completion_tokens.or(gen.max_tokens) {
        None => default_max.min(state.max_tokens),
        Some(m) if m < 1 => {
            return Err(ApiError::invalid("max_tokens", format!("max_tokens must be at least 1, got {m}")))
        }
        Some(m) if m as u64 > state.max_tokens as u64 => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("max_tokens {m} is above this server's limit of {} (--max-tokens)", state.max_tokens),
            ))
        }
        Some(m) => m as usize,
    };
    let temperature = gen.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature", format!("temperature must be in [0, 2], got {temperature}")));
    }
    let top_p = gen.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", format!("top_p must be in (0, 1], got {top_p}")));
    }
    let top_k = match gen.top_k {
        None | Some(0) | Some(-1) => None,
        Some(k) if k < 0 => {
            return Err(ApiError::invalid("top_k", format!("top_k must be at least 1 (or -1 for all), got {k}")))
        }
        Some(k) => Some(k as usize),
    };
    let mut stop = match &gen.stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s.clone()],
        Some(StopInput::Many(v)) => v.clone(),
    };
    if stop.len() > 4 {
        return Err(ApiError::invalid("stop", format!("at most 4 stop strings, got {}", stop.len())));
    }
    stop.extend(extra_stop);
    // Without a seed each request draws its own.
    let seed = gen.seed.unwrap_or_else(rand::random);
    Ok(Prepared {
        prompt,
        max_tokens,
        sampling: SamplingParams { temperature, top_k, top_p: gen.top_p, seed },
        stop,
        stream: gen.stream,
        include_usage: gen.stream_options.as_ref().is_some_and(|o| o.include_usage),
    })
}

fn encode(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    state.tokenizer.encode(text).map_err(|e| ApiError::invalid("prompt", format!("cannot tokenize the prompt: {e:#}")))
}

pub async fn completions(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let req: CompletionRequest = match parse_body(body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let prompt = match req.prompt {
        PromptInput::Text(t) => encode(&state, &t),
        PromptInput::Texts(v) if v.len() == 1 => encode(&state, &v[0]),
        PromptInput::Texts(v) => {
            Err(ApiError::invalid("prompt", format!("one prompt per request, got a list of {}", v.len())))
        }
        PromptInput::Tokens(ids) => Ok(ids),
    };
    // OpenAI's default for completions: 16 tokens.
    match prompt.and_then(|p| prepare(&state, &req.gen, p, 16, Vec::new())) {
        Ok(p) => run(state, Endpoint::Completions, p).await,
        Err(e) => e.into_response(),
    }
}

pub async fn chat_completions(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let req: ChatRequest = match parse_body(body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let prepared = (|| {
        if req.messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages is empty: give at least one message"));
        }
        let messages: Vec<Message> = req
            .messages
            .iter()
            .map(|m| Message {
                role: m.role.clone(),
                content: match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => parts.iter().filter_map(|p| p.text.as_deref()).collect(),
                },
            })
            .collect();
        let text = state.chat.render(&messages).map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?;
        let prompt = encode(&state, &text)?;
        // Chat's default: as many tokens as the context and the server's limit allow.
        prepare(&state, &req.gen, prompt, usize::MAX, state.chat.stop_strings())
    })();
    match prepared {
        Ok(p) => run(state, Endpoint::Chat, p).await,
        Err(e) => e.into_response(),
    }
}

/// Queues the request and answers it whole or as a stream of server-sent events.
async fn run(state: Arc<AppState>, endpoint: Endpoint, p: Prepared) -> Response {
    if state.draining() {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", "the server is shutting down")
            .into_response();
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt: p.prompt,
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        stop: p.stop,
        events: tx,
        arrived: Instant::now(),
    };
    match state.engine.submit(job) {
        Ok(()) => {}
        Err(SubmitError::QueueFull) => {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_full",
                format!("the queue is full ({} requests waiting); retry shortly", state.max_queue),
            )
            .into_response()
        }
        Err(SubmitError::Stopped) => {
            return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", "the server is shutting down")
                .into_response()
        }
    }
    let id = format!(
        "{}-{:016x}",
        if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" },
        state.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let shape = Shape { endpoint, id, created: unix_now(), model: state.model_id.clone() };
    if p.stream {
        stream(shape, rx, p.include_usage)
    } else {
        let mut text = String::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Text(t) => text.push_str(&t),
                Event::Done(usage) => return Json(shape.whole(&text, usage)).into_response(),
                Event::Failed(msg) => return failed(msg).into_response(),
            }
        }
        failed("the request ended without an answer".into()).into_response()
    }
}

fn failed(msg: String) -> ApiError {
    if msg.contains("shutting down") {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", msg)
    } else {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "generation_failed", msg)
    }
}

/// The fixed parts of one response's objects.
struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens})
}

impl Shape {
    fn whole(&self, text: &str, usage: Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": usage.finish_reason})
            }
            Endpoint::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
                                     "logprobs": null, "finish_reason": usage.finish_reason}),
        };
        let object = if self.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [choice], "usage": usage_json(&usage)})
    }

    /// One streamed chunk: a text piece (`delta`), or the end (`finish`).
    fn chunk(&self, delta: Option<&str>, finish: Option<FinishReason>, first: bool) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": delta.unwrap_or(""), "logprobs": null,
                                            "finish_reason": finish}),
            Endpoint::Chat => {
                let mut d = serde_json::Map::new();
                if first {
                    d.insert("role".into(), "assistant".into());
                }
                if let Some(t) = delta {
                    d.insert("content".into(), t.into());
                }
                json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": finish})
            }
        };
        self.envelope(json!([choice]))
    }

    fn envelope(&self, choices: Value) -> Value {
        let object = if self.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }
}

/// Streams the engine's events as OpenAI chunks, then `data: [DONE]`. When the client goes away
/// the response body is dropped, the forwarding task sees its channel close and drops the
/// engine's receiver, and the engine frees the request's slot before its next step.
fn stream(shape: Shape, mut events: mpsc::UnboundedReceiver<Event>, include_usage: bool) -> Response {
    let (tx, rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let send = |v: Value| SseEvent::default().data(v.to_string());
        let mut first = true;
        if shape.endpoint == Endpoint::Chat {
            if tx.send(Ok(send(shape.chunk(Some(""), None, true)))).await.is_err() {
                return;
            }
            first = false;
        }
        loop {
            let ev = tokio::select! {
                ev = events.recv() => ev,
                _ = tx.closed() => return,
            };
            let finished = !matches!(ev, Some(Event::Text(_)));
            let mut out = Vec::new();
            match ev {
                Some(Event::Text(t)) => out.push(send(shape.chunk(Some(&t), None, first))),
                Some(Event::Done(usage)) => {
                    out.push(send(shape.chunk(None, Some(usage.finish_reason), first)));
                    if include_usage {
                        let mut v = shape.envelope(json!([]));
                        v["usage"] = usage_json(&usage);
                        out.push(send(v));
                    }
                    out.push(SseEvent::default().data("[DONE]"));
                }
                Some(Event::Failed(msg)) => {
                    out.push(send(failed(msg).body()));
                    out.push(SseEvent::default().data("[DONE]"));
                }
                None => return,
            }
            first = false;
            for e in out {
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
            if finished {
                return;
            }
        }
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": state.model_id, "object": "model",
                "created": state.started_unix, "owned_by": "difftx"}]}))
}

pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.draining() {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting down"}))).into_response()
    } else {
        Json(json!({"status": "ok", "model": state.model_id})).into_response()
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "unknown_route", "no such endpoint (see GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics)")
}

/// Checks `Authorization: Bearer KEY` when the server has an API key.
pub fn authorized(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else { return Ok(()) };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    // Compared in constant time: the first mismatching byte must not show in the timing.
    let matches = given.is_some_and(|g| {
        g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    });
    if matches {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
        ))
    }
}
