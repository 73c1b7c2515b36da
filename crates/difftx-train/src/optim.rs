//! AdamW with decoupled weight decay on matrices only, and a warmup + decay learning-rate schedule.
//! The optimizer state (moments, step) is saved and restored with checkpoints so that a resumed
//! run continues exactly.

use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, DType, Layout, Storage, Tensor, Var};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Applied to parameters of rank >= 2 (matrices, embeddings) only.
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    fn default() -> Self {
        AdamWParams { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

struct Slot {
    name: String,
    var: Var,
    /// First and second moments, in the parameter's dtype, updated in place.
    moments: Moments,
    decay: bool,
}

/// Optimizer moments as plain buffers (the fused step updates them in place, no allocation).
enum Moments {
    F32 { m: Vec<f32>, v: Vec<f32> },
    F64 { m: Vec<f64>, v: Vec<f64> },
}

impl Moments {
    fn zeros(dtype: DType, n: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => Moments::F32 { m: vec![0.0; n], v: vec![0.0; n] },
            DType::F64 => Moments::F64 { m: vec![0.0; n], v: vec![0.0; n] },
            dt => bail!("AdamW supports f32 and f64 parameters, got {dt:?}"),
        })
    }

    fn tensors(&self, shape: &[usize]) -> Result<(Tensor, Tensor)> {
        let dev = candle_core::Device::Cpu;
        Ok(match self {
            Moments::F32 { m, v } => (Tensor::from_slice(m, shape, &dev)?, Tensor::from_slice(v, shape, &dev)?),
            Moments::F64 { m, v } => (Tensor::from_slice(m, shape, &dev)?, Tensor::from_slice(v, shape, &dev)?),
        })
    }

    fn set(&mut self, which: &str, t: &Tensor) -> Result<()> {
        let flat = t.flatten_all()?;
        match self {
            Moments::F32 { m, v } => *(if which == "m" { m } else { v }) = flat.to_dtype(DType::F32)?.to_vec1()?,
            Moments::F64 { m, v } => *(if which == "m" { m } else { v }) = flat.to_dtype(DType::F64)?.to_vec1()?,
        }
        Ok(())
    }
}

/// Scalars of one AdamW update, shared by every element.
#[derive(Debug, Clone, Copy)]
struct StepScalars {
    beta1: f64,
    beta2: f64,
    eps: f64,
    bc1: f64,
    bc2: f64,
    lr: f64,
    /// 1 - lr * weight_decay for decayed parameters, else 1.
    keep: f64,
    /// Factor on every gradient (clipping, accumulation's mean); 1 leaves it as it is.
    grad_scale: f64,
}

/// The fused AdamW update over flat slices of one parameter (all the same length), in place,
/// with g the gradient times `grad_scale` (rounded as a separate scaling pass would round it):
///   m = b1·m + (1-b1)·g;  v = b2·v + (1-b2)·g²
///   θ = θ·keep - lr · (m / bc1) / (sqrt(v / bc2) + eps)
/// Element-wise, so the result does not depend on how the work is split between threads.
fn adamw_slices<T: AdamFloat>(theta: &mut [T], g: &[T], m: &mut [T], v: &mut [T], k: StepScalars) {
    use rayon::prelude::*;
    let c = |x: f64| T::of(x);
    let (b1, b2, ob1, ob2, eps, lr, keep) =
        (c(k.beta1), c(k.beta2), c(1.0 - k.beta1), c(1.0 - k.beta2), c(k.eps), c(k.lr), c(k.keep));
    let (ibc1, ibc2, gs) = (c(1.0 / k.bc1), c(1.0 / k.bc2), c(k.grad_scale));
    const CHUNK: usize = 1 << 14;
    theta
        .par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((th, g), (m, v))| {
            for (((t, &g), m), v) in th.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = g * gs;
                let mn = b1 * *m + ob1 * g;
                let vn = b2 * *v + ob2 * g * g;
                *m = mn;
                *v = vn;
                *t = *t * keep - lr * (mn * ibc1) / ((vn * ibc2).sqrt() + eps);
            }
        });
}

/// f32 / f64 arithmetic the fused step needs.
trait AdamFloat:
    Copy
    + Send
    + Sync
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    fn of(x: f64) -> Self;
    fn sqrt(self) -> Self;
    fn sq_f64(self) -> f64;
}
impl AdamFloat for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn sq_f64(self) -> f64 {
        (self as f64) * (self as f64)
    }
}
impl AdamFloat for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn sq_f64(self) -> f64 {
        self * self
    }
}

/// candle glue: updates the parameter's storage in place from the gradient and the moments.
struct AdamWOp<'a> {
    moments: std::cell::RefCell<&'a mut Moments>,
    k: StepScalars,
}

impl candle_core::InplaceOp2 for AdamWOp<'_> {
    fn name(&self) -> &'static str {
        "difftx-adamw"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<()> {
        let (Some((a1, e1)), Some((a2, e2))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("difftx-adamw: parameter and gradient must be contiguous");
        };
        let mut moments = self.moments.borrow_mut();
        match (s1, s2, &mut **moments) {
            (CpuStorage::F32(th), CpuStorage::F32(g), Moments::F32 { m, v }) => {
                adamw_slices(&mut th[a1..e1], &g[a2..e2], m, v, self.k)
            }
            (CpuStorage::F64(th), CpuStorage::F64(g), Moments::F64 { m, v }) => {
                adamw_slices(&mut th[a1..e1], &g[a2..e2], m, v, self.k)
            }
            _ => candle_core::bail!("difftx-adamw: parameter, gradient and moments must share one dtype (f32 or f64)"),
        }
        Ok(())
    }
}

pub struct AdamW {
    params: AdamWParams,
    slots: Vec<Slot>,
    step: usize,
}

impl AdamW {
    pub fn new(vars: &[(String, Var)], params: AdamWParams) -> Result<Self> {
        let slots = vars
            .iter()
            .map(|(name, var)| {
                let t = var.as_tensor();
                if !t.is_contiguous() {
                    bail!("AdamW: parameter '{name}' is not contiguous");
                }
                Ok(Slot {
                    name: name.clone(),
                    var: var.clone(),
                    moments: Moments::zeros(t.dtype(), t.elem_count())?,
                    decay: t.rank() >= 2,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW { params, slots, step: 0 })
    }

    /// Number of updates applied so far.
    pub fn step_count(&self) -> usize {
        self.step
    }

    /// One update with learning rate `lr` from `grads` (missing gradients count as zero): one
    /// fused in-place pass per parameter over θ, m, v and the gradient.
    pub fn step(&mut self, grads: &candle_core::backprop::GradStore, lr: f64) -> Result<()> {
        self.step_scaled(grads, lr, 1.0)
    }

    /// [`AdamW::step`] from the gradients times `grad_scale` (global-norm clipping, the mean of
    /// accumulated micro-batches), scaled inside the update's pass: the same values as scaling
    /// the gradients first, without a pass that writes scaled copies of them all.
    pub fn step_scaled(&mut self, grads: &candle_core::backprop::GradStore, lr: f64, grad_scale: f64) -> Result<()> {
        self.step += 1;
        let AdamWParams { beta1, beta2, eps, weight_decay } = self.params;
        let bc1 = 1.0 - beta1.powi(self.step as i32);
        let bc2 = 1.0 - beta2.powi(self.step as i32);
        for slot in self.slots.iter_mut() {
            let Some(g) = grads.get(slot.var.as_tensor()) else { continue };
            let theta = slot.var.as_tensor();
            if g.dims() != theta.dims() {
                bail!("AdamW: gradient of '{}' has shape {:?}, the parameter {:?}", slot.name, g.dims(), theta.dims());
            }
            let g = g.to_dtype(theta.dtype())?.contiguous()?;
            let keep = if slot.decay { 1.0 - lr * weight_decay } else { 1.0 };
            let k = StepScalars { beta1, beta2, eps, bc1, bc2, lr, keep, grad_scale };
            theta.inplace_op2(&g, &AdamWOp { moments: std::cell::RefCell::new(&mut slot.moments), k })?;
        }
        Ok(())
    }

    /// Moments and step as named tensors (`m.NAME`, `v.NAME`, `step`).
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(2 * self.slots.len() + 1);
        for s in &self.slots {
            let (m, v) = s.moments.tensors(s.var.as_tensor().dims())?;
            out.push((format!("m.{}", s.name), m));
            out.push((format!("v.{}", s.name), v));
        }
        out.push(("step".into(), Tensor::new(&[self.step as u32], &candle_core::Device::Cpu)?));
        Ok(out)
    }

    /// Restores state saved by `state_tensors`; every parameter must be present with its shape.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        for s in self.slots.iter_mut() {
            let dims = s.var.as_tensor().dims().to_vec();
            for key in ["m", "v"] {
                let name = format!("{key}.{}", s.name);
                let t = state.get(&name).with_context(|| format!("optimizer state lacks '{name}'"))?;
                if t.dims() != dims.as_slice() {
                    bail!("optimizer state '{name}' has shape {:?}, expected {:?}", t.dims(), dims);
                }
                s.moments.set(key, t)?;
            }
        }
        let step = state.get("step").context("optimizer state lacks 'step'")?;
        self.step = step.to_dtype(DType::U32)?.to_vec1::<u32>()?[0] as usize;
        Ok(())
    }
}

/// Global L2 norm of all gradients (sums of squares in f64, in a fixed order: deterministic).
pub fn grad_norm(grads: &candle_core::backprop::GradStore, vars: &[(String, Var)]) -> Result<f64> {
    let mut total = 0.0f64;
    for (_, var) in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            total += sum_sq_f64(g)?;
        }
    }
    Ok(total.sqrt())
}

/// Σ x² of a CPU f32/f64 tensor, accumulated in f64 over fixed chunks, each chunk over `LANES`
/// interleaved partial sums (one running sum was bound by the latency of its additions: ~5 ms
/// for bench-s's 4.9M gradients on the Xeon of docs/design.md §7.15).
fn sum_sq_f64(t: &Tensor) -> Result<f64> {
    const LANES: usize = 8;
    fn chunk_sum<T: AdamFloat>(c: &[T]) -> f64 {
        let mut acc = [0f64; LANES];
        let mut it = c.chunks_exact(LANES);
        for part in &mut it {
            for (a, &v) in acc.iter_mut().zip(part) {
                *a += v.sq_f64();
            }
        }
        let tail: f64 = it.remainder().iter().map(|v| v.sq_f64()).sum();
        acc.iter().sum::<f64>() + tail
    }
    fn chunks<T: AdamFloat>(x: &[T]) -> f64 {
        use rayon::prelude::*;
        let parts: Vec<f64> = x.par_chunks(1 << 14).map(chunk_sum).collect();
        parts.iter().sum()
    }
    let t = t.contiguous()?;
    let (st, l) = t.storage_and_layout();
    let Some((a, e)) = l.contiguous_offsets() else { bail!("grad_norm: non-contiguous gradient") };
    Ok(match &*st {
        Storage::Cpu(CpuStorage::F32(x)) => chunks(&x[a..e]),
        Storage::Cpu(CpuStorage::F64(x)) => chunks(&x[a..e]),
        _ => t.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decay {
    Cosine,
    Linear,
    Constant,
}

impl std::str::FromStr for Decay {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cosine" => Ok(Decay::Cosine),
            "linear" => Ok(Decay::Linear),
            "constant" => Ok(Decay::Constant),
            _ => Err(format!("unknown schedule '{s}' (expected cosine, linear or constant)")),
        }
    }
}

/// Linear warmup to `peak`, then cosine/linear decay to `peak * min_ratio` at `total` steps.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Schedule {
    pub peak: f64,
    pub warmup: usize,
    pub total: usize,
    pub min_ratio: f64,
    pub decay: Decay,
}

impl Schedule {
    /// Learning rate for update number `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        let floor = self.peak * self.min_ratio;
        match self.decay {
            Decay::Constant => self.peak,
            Decay::Linear => floor + (self.peak - floor) * (1.0 - progress),
            Decay::Cosine => floor + (self.peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn schedule_warms_up_then_decays_to_floor() {
        let s = Schedule { peak: 1.0, warmup: 10, total: 110, min_ratio: 0.1, decay: Decay::Cosine };
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-12);
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
        let l = Schedule { decay: Decay::Linear, ..s };
        assert!((l.lr(60) - 0.55).abs() < 1e-12);
        assert!((l.lr(35) - 0.775).abs() < 1e-12);
    }

    /// The update as composed tensor ops (the formula the fused pass implements), at (step,
    /// learning rate, whether weight decay applies).
    fn composed_step(
        theta: &Tensor,
        m: &Tensor,
        v: &Tensor,
        g: &Tensor,
        (step, lr, decay): (usize, f64, bool),
        p: AdamWParams,
    ) -> (Tensor, Tensor, Tensor) {
        let bc1 = 1.0 - p.beta1.powi(step as i32);
        let bc2 = 1.0 - p.beta2.powi(step as i32);
        let m = ((m * p.beta1).unwrap() + (g * (1.0 - p.beta1)).unwrap()).unwrap();
        let v = ((v * p.beta2).unwrap() + (g.sqr().unwrap() * (1.0 - p.beta2)).unwrap()).unwrap();
        let update = ((&m / bc1).unwrap() / ((&v / bc2).unwrap().sqrt().unwrap() + p.eps).unwrap()).unwrap();
        let decayed = if decay { (theta * (1.0 - lr * p.weight_decay)).unwrap() } else { theta.clone() };
        ((decayed - (update * lr).unwrap()).unwrap(), m, v)
    }

    #[test]
    fn fused_adamw_equals_composed_ops_over_several_steps() {
        let dev = Device::Cpu;
        let p = AdamWParams { beta1: 0.8, beta2: 0.9, eps: 1e-6, weight_decay: 0.3 };
        // Awkward shapes: a matrix (decayed, strided gradient via a transpose, crosses the
        // parallel chunk size) and a short vector (not decayed); f64 and f32.
        for dt in [DType::F64, DType::F32] {
            let w0 = Tensor::randn(0f32, 1.0, (131, 127), &dev).unwrap().to_dtype(dt).unwrap();
            let b0 = Tensor::randn(0f32, 1.0, 7, &dev).unwrap().to_dtype(dt).unwrap();
            let (w, b) = (Var::from_tensor(&w0).unwrap(), Var::from_tensor(&b0).unwrap());
            let vars = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
            let mut opt = AdamW::new(&vars, p).unwrap();
            let (mut rw, mut rb) = (w0.clone(), b0.clone());
            let (mut mw, mut vw, mut mb, mut vb) = (
                w0.zeros_like().unwrap(),
                w0.zeros_like().unwrap(),
                b0.zeros_like().unwrap(),
                b0.zeros_like().unwrap(),
            );
            for step in 1..=4 {
                let cw = Tensor::randn(0f32, 1.0, (127, 131), &dev).unwrap().to_dtype(dt).unwrap();
                let cb = Tensor::randn(0f32, 1.0, 7, &dev).unwrap().to_dtype(dt).unwrap();
                // loss = Σ w ⊙ cwᵀ + Σ b² ⊙ cb: gradient cwᵀ (a strided view) and 2 b ⊙ cb.
                let loss = ((w.as_tensor() * cw.t().unwrap()).unwrap().sum_all().unwrap()
                    + (b.as_tensor().sqr().unwrap() * &cb).unwrap().sum_all().unwrap())
                .unwrap();
                let gb = ((&rb * 2.0).unwrap() * &cb).unwrap();
                let grads = loss.backward().unwrap();
                let lr = 0.01 * step as f64;
                opt.step(&grads, lr).unwrap();
                (rw, mw, vw) = composed_step(&rw, &mw, &vw, &cw.t().unwrap(), (step, lr, true), p);
                (rb, mb, vb) = composed_step(&rb, &mb, &vb, &gb, (step, lr, false), p);
            }
            let tol = if dt == DType::F64 { 1e-12 } else { 2e-5 };
            let err = |a: &Tensor, b: &Tensor| {
                (a - b)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            assert!(err(w.as_tensor(), &rw) < tol, "{dt:?} w: {}", err(w.as_tensor(), &rw));
            assert!(err(b.as_tensor(), &rb) < tol, "{dt:?} b: {}", err(b.as_tensor(), &rb));
            assert!(err(b.as_tensor(), &b0) > 0.01, "{dt:?}: the parameter did not move");
            let state: HashMap<String, Tensor> = opt.state_tensors().unwrap().into_iter().collect();
            assert!(err(&state["m.w"], &mw) < tol && err(&state["v.w"], &vw) < tol, "{dt:?} moments of w");
            assert!(err(&state["m.b"], &mb) < tol && err(&state["v.b"], &vb) < tol, "{dt:?} moments of b");
        }
    }

    #[test]
    fn grad_norm_equals_composed_sum_of_squares() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (300, 77), &dev).unwrap()).unwrap();
        let c = Tensor::randn(0f32, 1.0, (77, 300), &dev).unwrap();
        let loss = (w.as_tensor() * c.t().unwrap()).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let got = grad_norm(&grads, &[("w".into(), w)]).unwrap();
        let want = c.to_dtype(DType::F64).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
        assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
    }

    #[test]
    fn scaled_step_equals_the_step_on_scaled_gradients() {
        // The scale applied inside the update gives the bits of scaling the gradients first
        // (candle's f32 `g * factor`), over two steps, in f32 and f64.
        let dev = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            let init = Tensor::randn(0f64, 1.0, (37, 5), &dev).unwrap().to_dtype(dt).unwrap();
            let c = Tensor::randn(0f64, 1.0, (37, 5), &dev).unwrap().to_dtype(dt).unwrap();
            let factor = 0.37;
            let run = |scaled_inside: bool| {
                let w = Var::from_tensor(&init.copy().unwrap()).unwrap();
                let vars = vec![("w".to_string(), w.clone())];
                let mut opt = AdamW::new(&vars, AdamWParams::default()).unwrap();
                for _ in 0..2 {
                    let mut grads = (w.as_tensor() * &c).unwrap().sqr().unwrap().sum_all().unwrap().backward().unwrap();
                    if scaled_inside {
                        opt.step_scaled(&grads, 0.01, factor).unwrap();
                    } else {
                        let g = (grads.get(w.as_tensor()).unwrap() * factor).unwrap();
                        grads.insert(w.as_tensor(), g);
                        opt.step(&grads, 0.01).unwrap();
                    }
                }
                w.as_tensor().flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()
            };
            assert_eq!(run(true), run(false), "{dt:?}");
        }
    }

    #[test]
    fn grad_norm_sums_every_element() {
        // Lengths around the lanes and the chunks, against a plain f64 sum.
        let dev = Device::Cpu;
        for n in [1usize, 7, 8, 9, (1 << 14) + 3, 100_001] {
            let x: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin()).collect();
            let want: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>().sqrt();
            let var = Var::from_tensor(&Tensor::from_vec(x, n, &dev).unwrap()).unwrap();
            let grads = var.as_tensor().sum_all().unwrap().backward().unwrap();
            let mut store = grads;
            store.insert(var.as_tensor(), var.as_tensor().clone());
            let got = grad_norm(&store, &[("x".to_string(), var.clone())]).unwrap();
            assert!((got - want).abs() <= 1e-12 * want, "n {n}: {got} vs {want}");
        }
    }

    #[test]
    fn adamw_matches_hand_computed_update() {
        // f(w) = sum(w * c): gradient c. First Adam step moves each entry by lr * sign(c) (bias
        // corrected m/sqrt(v) = c/|c|), plus decoupled decay on matrices only.
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::new(&[[1.0f64, -2.0], [0.5, 3.0]], &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[1.0f64, 1.0], &dev).unwrap()).unwrap();
        let c = Tensor::new(&[[2.0f64, -1.0], [0.25, 4.0]], &dev).unwrap();
        let vars = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
        let mut opt = AdamW::new(&vars, AdamWParams { eps: 0.0, ..Default::default() }).unwrap();
        let loss = ((w.as_tensor() * &c).unwrap().sum_all().unwrap()
            + (b.as_tensor() * 3.0).unwrap().sum_all().unwrap())
        .unwrap();
        let grads = loss.backward().unwrap();
        opt.step(&grads, 0.1).unwrap();
        let got = w.as_tensor().to_vec2::<f64>().unwrap();
        let want = [[1.0 * 0.99 - 0.1, -2.0 * 0.99 + 0.1], [0.5 * 0.99 - 0.1, 3.0 * 0.99 - 0.1]];
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - w).abs() < 1e-12, "{g} vs {w}");
        }
        // The bias vector is not decayed.
        assert_eq!(b.as_tensor().to_vec1::<f64>().unwrap(), vec![0.9, 0.9]);
        // State round trip.
        let state: HashMap<String, Tensor> = opt.state_tensors().unwrap().into_iter().collect();
        let mut opt2 = AdamW::new(&vars, AdamWParams::default()).unwrap();
        opt2.load_state(&state).unwrap();
        assert_eq!(opt2.step_count(), 1);
        let mut missing = state.clone();
        missing.remove("v.w");
        assert!(opt2.load_state(&missing).unwrap_err().to_string().contains("v.w"));
    }
}
