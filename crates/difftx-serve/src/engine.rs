//! The decode loop: one thread that owns the model and steps every running request together
//! (continuous batching).
//!
//! A request (`Job`) waits in a bounded queue until a slot of the batch is free. Joining runs its
//! prompt (`prefill`) and samples its first token; from then on every step of the loop feeds each
//! running request its last token in one batched pass (`Decoder::step`) and samples each one's
//! next token with its own `Sampler` (its own temperature, top-p and seed). A request leaves as
//! soon as it finishes (stop string, end-of-sequence token, `max_tokens`, the context is full) or
//! its client stops listening (the receiving end of its event channel is dropped), and its slot
//! goes to the next request in the queue at the next step.
//!
//! With `EngineOptions::speculative`, a request that runs alone is decoded by speculative passes
//! instead of single steps: a bf16 copy of the model drafts tokens and one pass of the model
//! checks them (`difftx_core::generate::SpeculativeDraft`) with the request's sampler, whose draws
//! depend only on its seed, the token's index and the logits: the text is the same, greedy or
//! sampled.

use crate::metrics::Metrics;
use anyhow::{Context, Result};
use difftx_core::generate::{bf16_draft, sample_rows, Sampler, SamplingParams, SpeculativeDraft};
use difftx_core::model::last_logits;
use difftx_core::tokenizer::{StreamDecoder, Tokenizer};
use difftx_core::{Decoder, KvCache, KvPrecision, Model, SequenceCache, WeightPrecision};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a request hears back from the engine, in order: text pieces, then `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The next piece of generated text (never empty).
    Text(String),
    Done(Usage),
    /// The request was ended without finishing (the server is shutting down, or a model error).
    Failed(String),
}

/// Why a request stopped and how many tokens it took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop string or the end-of-sequence token.
    Stop,
    /// `max_tokens`, or the model's context is full.
    Length,
}

/// One generation request.
pub struct Job {
    pub prompt: Vec<u32>,
    /// At least 1.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before the first occurrence of any of these; it is not part of the text.
    pub stop: Vec<String>,
    pub events: UnboundedSender<Event>,
    /// When the request arrived (time to first token counts from here).
    pub arrived: Instant,
}

/// How the linear layers' weights are stored and run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeWeights {
    /// The fused decoder (`difftx_core::Decoder`) with f32, bf16 (bf16 products, f32 sums) or
    /// int8 (one scale per output channel) weights: every running request in one batched step.
    Fused(WeightPrecision),
    /// ggml-style quantised layers (q8_0, q4k) through `Model::forward`: the requests of a step
    /// run one after the other.
    Quantized(difftx_core::WeightFormat),
}

impl std::str::FromStr for ServeWeights {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        use difftx_core::WeightFormat;
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(ServeWeights::Fused(WeightPrecision::F32)),
            "bf16" => Ok(ServeWeights::Fused(WeightPrecision::Bf16)),
            "int8" => Ok(ServeWeights::Fused(WeightPrecision::Int8)),
            "q8_0" => Ok(ServeWeights::Quantized(WeightFormat::Q8_0)),
            "q4k" => Ok(ServeWeights::Quantized(WeightFormat::Q4K)),
            _ => Err(format!("unknown weights '{s}' (expected f32, bf16, int8, q8_0 or q4k)")),
        }
    }
}

/// Why `Engine::submit` did not take a request.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue holds its maximum of waiting requests.
    QueueFull,
    /// The engine has stopped.
    Stopped,
}

/// The running engine: a thread and the queue in front of it.
pub struct Engine {
    queue: SyncSender<Job>,
    cancel: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    metrics: Arc<Metrics>,
    context: usize,
}

/// Settings of the decode loop.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub weights: ServeWeights,
    /// How the fused decoder caches keys and values (`ServeWeights::Fused` only).
    pub kv_cache: KvPrecision,
    /// Requests decoded together at most.
    pub max_batch: usize,
    /// Requests waiting for a slot at most (beyond it `submit` answers `QueueFull`).
    pub max_queue: usize,
    /// Token that ends generation (a Hugging Face model's `eos_token_id`), if any.
    pub eos_token: Option<u32>,
    /// Drafts per pass of speculative decoding for a request that runs alone (a bf16 copy of the
    /// model drafts them; `ServeWeights::Fused` only); `None`: single steps always.
    pub speculative: Option<usize>,
}

impl Engine {
    /// Starts the decode loop on its own thread; it owns `model` from then on and shares `tokenizer`.
    pub fn start(
        mut model: Model,
        tokenizer: Arc<Tokenizer>,
        opts: EngineOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Self> {
        anyhow::ensure!(opts.max_batch >= 1, "--max-batch must be at least 1");
        // Every cache but f32 is the fused decoder's.
        if let ServeWeights::Quantized(format) = opts.weights {
            anyhow::ensure!(
                opts.kv_cache == KvPrecision::F32,
                "--kv-cache {} is the fused decoder's cache, which {} weights do not run through: \
                 use --weights f32, bf16 or int8, or --kv-cache f32",
                format!("{:?}", opts.kv_cache).to_lowercase(),
                format!("{format:?}").to_lowercase()
            );
        }
        match (opts.speculative, opts.weights) {
            (Some(0), _) => anyhow::bail!("--speculative must be at least 1 draft per pass"),
            (Some(_), ServeWeights::Quantized(format)) => anyhow::bail!(
                "--speculative runs the fused decoder, which {} weights do not run through: use --weights f32, \
                 bf16 or int8",
                format!("{format:?}").to_lowercase()
            ),
            _ => {}
        }
        // (The fused decoder checks that it can run the model itself, on the engine thread.)
        if let ServeWeights::Quantized(format) = opts.weights {
            model.quantize_weights(format)?;
        }
        let context = model.config().max_seq_len;
        let (queue, jobs) = std::sync::mpsc::sync_channel(opts.max_queue);
        let cancel = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let worker = Worker {
            token_ids: tokenizer.id_limit(),
            tokenizer,
            opts,
            jobs,
            cancel: cancel.clone(),
            stop: stop.clone(),
            metrics: metrics.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("difftx-decode".into())
            .spawn(move || worker.run(&model, ready_tx))
            .context("cannot start the decode thread")?;
        // The weights are packed on the engine thread; wait for it so errors surface here.
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(anyhow::anyhow!(e)),
            Err(_) => anyhow::bail!("the decode thread stopped while loading the model"),
        }
        Ok(Engine { queue, cancel, stop, thread: Mutex::new(Some(thread)), metrics, context })
    }

    /// The model's context length in tokens.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Queues a request; it joins the running batch as soon as a slot is free.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if self.stop.load(Ordering::SeqCst) || self.cancel.load(Ordering::SeqCst) {
            return Err(SubmitError::Stopped);
        }
        // Counted before sending so the engine's decrement can never come first.
        self.metrics.queue_depth.inc();
        match self.queue.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.metrics.queue_depth.dec();
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull,
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Ends every running and queued request now (`Event::Failed`), and refuses new ones.
    pub fn cancel_all(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// Cancels what is left and waits for the decode thread to exit.
    pub fn shutdown(&self) {
        self.cancel_all();
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// How the engine runs a step.
enum Backend<'m> {
    Fused(Box<Decoder>),
    Forward(&'m Model),
}

/// One request's keys and values.
enum Cache {
    Fused(SequenceCache),
    Forward(KvCache),
}

impl Backend<'_> {
    fn prefill(&self, prompt: &[u32]) -> Result<(Cache, Vec<f32>)> {
        match self {
            Backend::Fused(dec) => {
                let mut seq = dec.new_sequence();
                let logits = dec.prefill(&mut seq, prompt)?;
                Ok((Cache::Fused(seq), logits))
            }
            Backend::Forward(model) => {
                let mut cache = KvCache::new(model.config());
                let ids = candle_core::Tensor::new(prompt, model.device())?.unsqueeze(0)?;
                let logits = last_logits(&model.forward(&ids, Some(&mut cache))?)?;
                Ok((Cache::Forward(cache), logits))
            }
        }
    }

    /// Feeds `tokens[r]` to `caches[r]`; the next-token logits of each, row-major [r, vocab].
    fn step(&self, caches: &mut [&mut Cache], tokens: &[u32]) -> Result<Vec<f32>> {
        match self {
            Backend::Fused(dec) => {
                let mut seqs: Vec<&mut SequenceCache> = caches
                    .iter_mut()
                    .map(|c| match &mut **c {
                        Cache::Fused(s) => s,
                        Cache::Forward(_) => unreachable!("a fused engine holds fused caches"),
                    })
                    .collect();
                dec.step(&mut seqs, tokens)
            }
            Backend::Forward(model) => {
                let mut out = Vec::new();
                for (c, &t) in caches.iter_mut().zip(tokens) {
                    let Cache::Forward(cache) = &mut **c else { unreachable!("a forward engine holds kv caches") };
                    let ids = candle_core::Tensor::new(&[t], model.device())?.unsqueeze(0)?;
                    out.extend(last_logits(&model.forward(&ids, Some(cache))?)?);
                }
                Ok(out)
            }
        }
    }
}

impl Cache {
    fn len(&self) -> usize {
        match self {
            Cache::Fused(s) => s.len(),
            Cache::Forward(c) => c.seq_len(),
        }
    }
}

/// The engine thread's state.
struct Worker {
    tokenizer: Arc<Tokenizer>,
    /// The tokenizer's `id_limit`, which every request's sampler draws below (computed once: a
    /// Hugging Face tokenizer's is a pass over its vocabulary).
    token_ids: usize,
    opts: EngineOptions,
    jobs: Receiver<Job>,
    cancel: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

/// A request in the running batch.
struct Running<'t> {
    cache: Cache,
    sampler: Sampler,
    text: TextStream<'t>,
    /// The token to feed at the next step (the last one sampled).
    next: u32,
    /// The speculative draft's side of the request (`EngineOptions::speculative`): passes
    /// run while the request is alone, and each token it is fed in a batched step is passed on.
    drafter: Option<SpeculativeDraft>,
    generated: usize,
    max_tokens: usize,
    prompt_tokens: usize,
    events: UnboundedSender<Event>,
    last_token_at: Instant,
}

impl Worker {
    fn run(self, model: &Model, ready: std::sync::mpsc::Sender<Result<(), String>>) {
        let decoders = || -> Result<(Backend, Option<Decoder>)> {
            Ok(match self.opts.weights {
                ServeWeights::Fused(precision) => {
                    let mut d = Decoder::with_precision(model, precision)?;
                    d.set_kv_precision(self.opts.kv_cache);
                    let draft = self.opts.speculative.map(|_| bf16_draft(model)).transpose()?;
                    (Backend::Fused(Box::new(d)), draft)
                }
                ServeWeights::Quantized(_) => (Backend::Forward(model), None),
            })
        };
        let (backend, draft) = match decoders() {
            Ok(d) => d,
            Err(e) => {
                let _ = ready.send(Err(format!("{e:#}")));
                return;
            }
        };
        let speculation = match (&backend, &draft, self.opts.speculative) {
            (Backend::Fused(target), Some(draft), Some(draft_len)) => Some((&**target, draft, draft_len)),
            _ => None,
        };
        let _ = ready.send(Ok(()));
        let context = model.config().max_seq_len;
        let mut running: Vec<Running> = Vec::new();
        loop {
            if self.cancel.load(Ordering::SeqCst) {
                for r in running.drain(..) {
                    let _ = r.events.send(Event::Failed("the server is shutting down".into()));
                }
                while let Ok(job) = self.jobs.try_recv() {
                    self.metrics.queue_depth.dec();
                    let _ = job.events.send(Event::Failed("the server is shutting down".into()));
                }
                if self.stop.load(Ordering::SeqCst) {
                    self.metrics.running.set(0);
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            // Requests whose client has gone leave before the step.
            running.retain(|r| !r.events.is_closed());
            // Fill free slots from the queue; wait (briefly, to see cancellation) only when idle.
            while running.len() < self.opts.max_batch {
                let job = if running.is_empty() {
                    match self.jobs.recv_timeout(Duration::from_millis(50)) {
                        Ok(job) => job,
                        Err(RecvTimeoutError::Timeout) => break,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                } else {
                    match self.jobs.try_recv() {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                };
                self.metrics.queue_depth.dec();
                if job.events.is_closed() {
                    continue;
                }
                if let Some(r) = self.join(&backend, speculation.map(|(t, d, _)| (t, d)), job, context) {
                    running.push(r);
                }
            }
            self.metrics.running.set(running.len() as i64);
            if running.is_empty() {
                continue;
            }
            self.metrics.batch_size.observe(running.len() as f64);
            if let (Some((target, draft, draft_len)), [r]) = (speculation, &mut running[..]) {
                if r.drafter.is_some() {
                    if self.speculative_pass(r, target, draft, draft_len, context) {
                        running.clear();
                    }
                    self.metrics.running.set(running.len() as i64);
                    continue;
                }
            }
            let tokens: Vec<u32> = running.iter().map(|r| r.next).collect();
            let logits = {
                let mut caches: Vec<&mut Cache> = running.iter_mut().map(|r| &mut r.cache).collect();
                // A panic in a kernel must not stop the server: this step's requests fail (their
                // caches may be half written), the loop goes on with the next ones.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.step(&mut caches, &tokens)))
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("internal error: the decode step panicked")))
            };
            let logits = match logits {
                Ok(l) => l,
                Err(e) => {
                    for r in running.drain(..) {
                        let _ = r.events.send(Event::Failed(format!("model error: {e:#}")));
                    }
                    continue;
                }
            };
            let mut samplers: Vec<&mut Sampler> = running.iter_mut().map(|r| &mut r.sampler).collect();
            let mut draws = sample_rows(&mut samplers, &logits).into_iter();
            running.retain_mut(|r| {
                if let Some(d) = &mut r.drafter {
                    d.push(r.next);
                }
                let next = draws.next().expect("a draw per request");
                let cached = r.cache.len();
                !self.take_token(r, next, cached, context)
            });
            self.metrics.running.set(running.len() as i64);
        }
    }

    /// One speculative pass of a request running alone: its drafts and the model's check, then
    /// the tokens the pass gave, in order, up to the one that finishes it. Returns whether it is
    /// finished (or failed).
    fn speculative_pass(
        &self,
        r: &mut Running,
        target: &Decoder,
        draft: &Decoder,
        draft_len: usize,
        context: usize,
    ) -> bool {
        let (Cache::Fused(seq), Some(drafter)) = (&mut r.cache, &mut r.drafter) else {
            unreachable!("a speculative request has a fused cache and a draft")
        };
        let start = seq.len();
        let wanted = r.max_tokens - r.generated;
        let pass = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            drafter.pass(target, draft, seq, r.next, draft_len, wanted, &mut r.sampler)
        }))
        .unwrap_or_else(|_| Err(anyhow::anyhow!("internal error: the speculative pass panicked")));
        let pass = match pass {
            Ok(p) => p,
            Err(e) => {
                let _ = r.events.send(Event::Failed(format!("model error: {e:#}")));
                return true;
            }
        };
        self.metrics.speculative_drafted_tokens.inc_by(pass.drafted as u64);
        self.metrics.speculative_accepted_tokens.inc_by(pass.accepted as u64);
        // Token i of the pass follows `next` and the i drafts before it: single steps would have
        // cached `start + 1 + i` positions when giving it out.
        pass.tokens.iter().enumerate().any(|(i, &t)| self.take_token(r, t, start + 1 + i, context))
    }

    /// Runs a new request's prompt and its first token; `None` if it is already finished.
    /// `speculation`: the model's and the draft's decoders when requests get a draft.
    fn join<'t>(
        &'t self,
        backend: &Backend,
        speculation: Option<(&Decoder, &Decoder)>,
        job: Job,
        context: usize,
    ) -> Option<Running<'t>> {
        let started = || -> Result<(Cache, Sampler, Vec<f32>)> {
            let sampler = Sampler::new(job.sampling.clone())?.limited_to(self.token_ids);
            let (cache, logits) =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.prefill(&job.prompt)))
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("internal error: the prompt's pass panicked")))?;
            Ok((cache, sampler, logits))
        };
        let (cache, mut sampler, logits) = match started() {
            Ok(s) => s,
            Err(e) => {
                let _ = job.events.send(Event::Failed(format!("{e:#}")));
                return None;
            }
        };
        self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
        let first = sampler.sample(&logits);
        let drafter = match speculation {
            Some((target, draft)) => {
                Some(SpeculativeDraft::new(target, draft, &job.prompt).expect("the draft is the model in bf16"))
            }
            None => None,
        };
        let cached = cache.len();
        let mut r = Running {
            cache,
            sampler,
            text: TextStream::new(&self.tokenizer, job.stop),
            next: first,
            drafter,
            generated: 0,
            max_tokens: job.max_tokens,
            prompt_tokens: job.prompt.len(),
            events: job.events,
            last_token_at: job.arrived,
        };
        if self.take_token(&mut r, first, cached, context) {
            None
        } else {
            Some(r)
        }
    }

    /// Records a sampled token, which follows `cached` positions of the sequence: sends its text,
    /// and `Done` when the request is finished. Returns whether it is.
    fn take_token(&self, r: &mut Running, token: u32, cached: usize, context: usize) -> bool {
        let now = Instant::now();
        let latency = now.duration_since(r.last_token_at).as_secs_f64();
        if r.generated == 0 {
            self.metrics.time_to_first_token.observe(latency);
        } else {
            self.metrics.time_per_output_token.observe(latency);
        }
        r.last_token_at = now;
        r.generated += 1;
        r.next = token;
        self.metrics.generated_tokens.inc();
        let mut finish = None;
        let piece = if Some(token) == self.opts.eos_token {
            finish = Some(FinishReason::Stop);
            r.text.finish()
        } else {
            match r.text.push(token) {
                Ok(Some(piece)) => piece,
                Ok(None) => String::new(),
                Err(e) => {
                    let _ = r.events.send(Event::Failed(format!("cannot decode token {token}: {e:#}")));
                    return true;
                }
            }
        };
        if r.text.stopped {
            finish = Some(FinishReason::Stop);
        }
        let piece = if finish.is_none() && (r.generated >= r.max_tokens || cached >= context) {
            finish = Some(FinishReason::Length);
            piece + &r.text.finish()
        } else {
            piece
        };
        if !piece.is_empty() {
            let _ = r.events.send(Event::Text(piece));
        }
        if let Some(finish_reason) = finish {
            let usage = Usage { finish_reason, prompt_tokens: r.prompt_tokens, completion_tokens: r.generated };
            let _ = r.events.send(Event::Done(usage));
            return true;
        }
        false
    }
}

/// Turns tokens into text pieces, holding back what could be the start of a stop string.
pub struct TextStream<'t> {
    decoder: StreamDecoder<'t>,
    stop: Vec<String>,
    /// Text decoded and not yet released.
    held: String,
    /// A stop string was found: nothing more is released.
    pub stopped: bool,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer, stop: Vec<String>) -> Self {
        let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
        TextStream { decoder: StreamDecoder::new(tokenizer), stop, held: String::new(), stopped: false }
    }

    /// Adds a token; returns the text that is now safe to release (`None`: nothing yet).
    pub fn push(&mut self, token: u32) -> Result<Option<String>> {
        if self.stopped {
            return Ok(None);
        }
        let piece = self.decoder.push(token)?;
        self.held.push_str(&piece);
        Ok(self.release(false))
    }

    /// Everything still held (the end of the text: a partial stop string is released as text).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        if let Ok(rest) = self.decoder.finish() {
            self.held.push_str(&rest);
        }
        self.release(true).unwrap_or_default()
    }

    fn release(&mut self, at_end: bool) -> Option<String> {
        // A stop string inside the held text ends the stream before it.
        let first_stop = self.stop.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first_stop {
            self.stopped = true;
            let out: String = self.held.drain(..at).collect();
            self.held.clear();
            return (!out.is_empty()).then_some(out);
        }
        // Hold back the longest tail that is a prefix of a stop string.
        let keep = if at_end {
            0
        } else {
            (1..=self.held.len())
                .rev()
                .filter(|&n| self.held.is_char_boundary(self.held.len() - n))
                .find(|&n| {
                    let tail = &self.held[self.held.len() - n..];
                    self.stop.iter().any(|s| s.starts_with(tail))
                })
                .unwrap_or(0)
        };
        let cut = self.held.len() - keep;
        let out: String = self.held.drain(..cut).collect();
        (!out.is_empty()).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(stop: &[&str], text: &str) -> (Vec<String>, String, bool) {
        let tok = Tokenizer::bytes();
        let mut s = TextStream::new(&tok, stop.iter().map(|s| s.to_string()).collect());
        let mut pieces = Vec::new();
        for b in text.bytes() {
            if let Some(p) = s.push(b as u32).unwrap() {
                pieces.push(p);
            }
        }
        let rest = s.finish();
        if !rest.is_empty() {
            pieces.push(rest);
        }
        let all = pieces.concat();
        (pieces, all, s.stopped)
    }

    #[test]
    fn stop_strings_end_the_text_before_them() {
        let (_, text, stopped) = stream(&["\nUser:"], "Hello there.\nUser: more");
        assert_eq!(text, "Hello there.");
        assert!(stopped);
        // The earliest of several stop strings wins.
        let (_, text, _) = stream(&["xyz", "lo"], "Hello xyz");
        assert_eq!(text, "Hel");
    }

    #[test]
    fn a_partial_stop_string_is_held_back_then_released() {
        let (pieces, text, stopped) = stream(&["END"], "abEN!cdE");
        assert_eq!(text, "abEN!cdE");
        assert!(!stopped);
        // "E" and "EN" were held until the next byte showed they were not "END".
        assert!(pieces.iter().all(|p| !p.ends_with('E') || p == "E" || p.ends_with("cdE")), "{pieces:?}");
    }

    #[test]
    fn multibyte_characters_come_out_whole() {
        let (pieces, text, _) = stream(&["ü!"], "grüße ü?");
        assert_eq!(text, "grüße ü?");
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
        let (_, text, stopped) = stream(&["ü!"], "grüße ü! weiter");
        assert_eq!((text.as_str(), stopped), ("grüße ", true));
    }
}
