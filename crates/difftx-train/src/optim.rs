//! AdamW with decoupled weight decay on matrices only, and a warmup + decay learning-rate schedule.
//! The optimizer state (moments, step) is saved and restored with checkpoints so that a resumed
//! run continues exactly.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
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
    m: Tensor,
    v: Tensor,
    decay: bool,
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
                let zeros = var.as_tensor().zeros_like()?;
                Ok(Slot { name: name.clone(), var: var.clone(), m: zeros.clone(), v: zeros, decay: var.as_tensor().rank() >= 2 })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW { params, slots, step: 0 })
    }

    /// Number of updates applied so far.
    pub fn step_count(&self) -> usize {
        self.step
    }

    /// One update with learning rate `lr` from `grads` (missing gradients count as zero).
    pub fn step(&mut self, grads: &candle_core::backprop::GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let AdamWParams { beta1, beta2, eps, weight_decay } = self.params;
        let bc1 = 1.0 - beta1.powi(self.step as i32);
        let bc2 = 1.0 - beta2.powi(self.step as i32);
        for slot in self.slots.iter_mut() {
            let Some(g) = grads.get(slot.var.as_tensor()) else { continue };
            slot.m = ((&slot.m * beta1)? + (g * (1.0 - beta1))?)?;
            slot.v = ((&slot.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let update = ((&slot.m / bc1)? / ((&slot.v / bc2)?.sqrt()? + eps)?)?;
            let theta = slot.var.as_tensor();
            let decayed = if slot.decay { (theta * (1.0 - lr * weight_decay))? } else { theta.clone() };
            slot.var.set(&(decayed - (update * lr)?)?)?;
        }
        Ok(())
    }

    /// Moments and step as named tensors (`m.NAME`, `v.NAME`, `step`).
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(2 * self.slots.len() + 1);
        for s in &self.slots {
            out.push((format!("m.{}", s.name), s.m.clone()));
            out.push((format!("v.{}", s.name), s.v.clone()));
        }
        out.push(("step".into(), Tensor::new(&[self.step as u32], &candle_core::Device::Cpu)?));
        Ok(out)
    }

    /// Restores state saved by `state_tensors`; every parameter must be present with its shape.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        for s in self.slots.iter_mut() {
            for (key, slot) in [("m", &mut s.m), ("v", &mut s.v)] {
                let name = format!("{key}.{}", s.name);
                let t = state.get(&name).with_context(|| format!("optimizer state lacks '{name}'"))?;
                if t.dims() != slot.dims() {
                    bail!("optimizer state '{name}' has shape {:?}, expected {:?}", t.dims(), slot.dims());
                }
                *slot = t.to_dtype(slot.dtype())?;
            }
        }
        let step = state.get("step").context("optimizer state lacks 'step'")?;
        self.step = step.to_dtype(DType::U32)?.to_vec1::<u32>()?[0] as usize;
        Ok(())
    }
}


/// Global L2 norm of all gradients, and the factor that clips it to `max_norm` (1.0 if below).
pub fn grad_norm(grads: &candle_core::backprop::GradStore, vars: &[(String, Var)]) -> Result<f64> {
    let mut total = 0.0f64;
    for (_, var) in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            total += g.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        }
    }
    Ok(total.sqrt())
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
        let loss = ((w.as_tensor() * &c).unwrap().sum_all().unwrap() + (b.as_tensor() * 3.0).unwrap().sum_all().unwrap()).unwrap();
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
