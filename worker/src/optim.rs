//! The optimizers of a training run and their state: plain SGD (candle-nn's [`candle_nn::SGD`],
//! which keeps no state) and AdamW ([`AdamW`]), whose moments and step count travel in
//! checkpoints and in the state broadcast to a joiner.
//!
//! candle-nn 0.9's `AdamW` keeps its moments and step count in private fields with no accessor,
//! so they could be neither saved nor broadcast. [`AdamW`] is a copy of its update, the same
//! tensor operations in the same order (candle-nn 0.9.2, `src/optim.rs`, `impl Optimizer for
//! AdamW`, fn `step`), with the state exposed; a unit test checks that both give bit-identical
//! parameters step after step. Its hyper-parameters are candle-nn's [`ParamsAdamW`].

use candle_core::{Device, Tensor, Var, backprop::GradStore};
use candle_nn::{Optimizer, ParamsAdamW};

use crate::model::{fuse, unfuse};

/// Which optimizer a run uses (identical on every rank, recorded in checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimizerKind {
    /// Plain SGD: `θ ← θ − lr·g`. No state.
    #[default]
    Sgd,
    /// AdamW with candle-nn's defaults but the learning rate (β₁ 0.9, β₂ 0.999, ε 1e-8, weight
    /// decay 0.01). State: first and second moments per parameter and the step count.
    AdamW,
}

impl OptimizerKind {
    /// The name used on the command line and in checkpoint metadata: `sgd`, `adamw`.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::AdamW => "adamw",
        }
    }

    /// The kind named `name` (see [`OptimizerKind::name`]).
    pub fn from_name(name: &str) -> Option<OptimizerKind> {
        match name {
            "sgd" => Some(OptimizerKind::Sgd),
            "adamw" => Some(OptimizerKind::AdamW),
            _ => None,
        }
    }

    /// The default learning rate of this optimizer for the digits model: 0.5 for SGD (the
    /// summed-then-averaged gradient of a 64-sample batch), candle-nn's 0.001 for AdamW.
    pub fn default_lr(self) -> f64 {
        match self {
            OptimizerKind::Sgd => 0.5,
            OptimizerKind::AdamW => ParamsAdamW::default().lr,
        }
    }

    /// Number of `f32` values of its state for a model of `params` parameters (the moments;
    /// the step count travels separately).
    pub fn state_floats(self, params: usize) -> usize {
        match self {
            OptimizerKind::Sgd => 0,
            OptimizerKind::AdamW => 2 * params,
        }
    }
}

/// The state of an optimizer, flattened in the model's parameter order.
#[derive(Debug, Clone, PartialEq)]
pub enum OptState {
    /// SGD has none.
    Sgd,
    /// AdamW's state.
    AdamW {
        /// Updates applied so far (candle-nn's `step_t`; the bias corrections use it).
        step: u64,
        /// First moments, one per parameter.
        m: Vec<f32>,
        /// Second moments, one per parameter.
        v: Vec<f32>,
    },
}

impl OptState {
    /// The kind of optimizer this state belongs to.
    pub fn kind(&self) -> OptimizerKind {
        match self {
            OptState::Sgd => OptimizerKind::Sgd,
            OptState::AdamW { .. } => OptimizerKind::AdamW,
        }
    }
}

#[derive(Debug)]
struct VarAdamW {
    var: Var,
    first_moment: Var,
    second_moment: Var,
}

/// AdamW as candle-nn 0.9.2 computes it (see the module docs), with its state readable and
/// settable.
#[derive(Debug)]
pub struct AdamW {
    vars: Vec<VarAdamW>,
    step_t: usize,
    params: ParamsAdamW,
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        let vars = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| {
                let (dtype, shape, device) = (var.dtype(), var.shape(), var.device());
                let first_moment = Var::zeros(shape, dtype, device)?;
                let second_moment = Var::zeros(shape, dtype, device)?;
                Ok(VarAdamW {
                    var,
                    first_moment,
                    second_moment,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(AdamW {
            vars,
            params,
            step_t: 0,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    // candle-nn 0.9.2 src/optim.rs, AdamW::step, line for line.
    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let lr = self.params.lr;
        let lambda = self.params.weight_decay;
        let lr_lambda = lr * lambda;
        let beta1 = self.params.beta1;
        let beta2 = self.params.beta2;
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        for var in self.vars.iter() {
            let theta = &var.var;
            let m = &var.first_moment;
            let v = &var.second_moment;
            if let Some(g) = grads.get(theta) {
                let next_m = ((m.as_tensor() * beta1)? + (g * (1.0 - beta1))?)?;
                let next_v = ((v.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                let m_hat = (&next_m * scale_m)?;
                let v_hat = (&next_v * scale_v)?;
                let next_theta = (theta.as_tensor() * (1f64 - lr_lambda))?;
                let adjusted_grad = (m_hat / (v_hat.sqrt()? + self.params.eps)?)?;
                let next_theta = (next_theta - (adjusted_grad * lr)?)?;
                m.set(&next_m)?;
                v.set(&next_v)?;
                theta.set(&next_theta)?;
            }
        }
        Ok(())
    }
}

fn flat(vars: impl Iterator<Item = Var>) -> candle_core::Result<Vec<f32>> {
    let parts = vars
        .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(fuse(&parts, &[]))
}

impl AdamW {
    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// The state: step count and both moments, flattened in parameter order.
    ///
    /// # Errors
    /// A candle error reading the moments.
    pub fn state(&self) -> candle_core::Result<OptState> {
        Ok(OptState::AdamW {
            step: self.step_t as u64,
            m: flat(self.vars.iter().map(|v| v.first_moment.clone()))?,
            v: flat(self.vars.iter().map(|v| v.second_moment.clone()))?,
        })
    }

    /// Overwrites the step count and the moments (flattened in parameter order, as
    /// [`AdamW::state`] gives them).
    ///
    /// # Errors
    /// A candle error when a moment vector does not have one value per parameter.
    pub fn set_state(&mut self, step: u64, m: &[f32], v: &[f32]) -> candle_core::Result<()> {
        let lens: Vec<usize> = self.vars.iter().map(|v| v.var.elem_count()).collect();
        let n: usize = lens.iter().sum();
        if m.len() != n || v.len() != n {
            candle_core::bail!(
                "AdamW state of {} and {} moments for {n} parameters",
                m.len(),
                v.len()
            );
        }
        for ((var, mp), vp) in self.vars.iter().zip(unfuse(m, &lens)).zip(unfuse(v, &lens)) {
            let shape = var.var.shape();
            var.first_moment
                .set(&Tensor::from_slice(mp, shape, &Device::Cpu)?)?;
            var.second_moment
                .set(&Tensor::from_slice(vp, shape, &Device::Cpu)?)?;
        }
        self.step_t = usize::try_from(step).map_err(candle_core::Error::wrap)?;
        Ok(())
    }
}

/// The optimizer of a run: one of [`OptimizerKind`].
#[derive(Debug)]
pub enum Optim {
    /// candle-nn's SGD.
    Sgd(candle_nn::SGD),
    /// [`AdamW`].
    AdamW(AdamW),
}

impl Optim {
    /// An optimizer of `kind` over `vars` with learning rate `lr` (AdamW: candle-nn's other
    /// defaults).
    ///
    /// # Errors
    /// A candle error allocating the state.
    pub fn new(kind: OptimizerKind, vars: Vec<Var>, lr: f64) -> candle_core::Result<Optim> {
        Ok(match kind {
            OptimizerKind::Sgd => Optim::Sgd(candle_nn::SGD::new(vars, lr)?),
            OptimizerKind::AdamW => Optim::AdamW(AdamW::new(
                vars,
                ParamsAdamW {
                    lr,
                    ..ParamsAdamW::default()
                },
            )?),
        })
    }

    /// Which optimizer this is.
    pub fn kind(&self) -> OptimizerKind {
        match self {
            Optim::Sgd(_) => OptimizerKind::Sgd,
            Optim::AdamW(_) => OptimizerKind::AdamW,
        }
    }

    /// Its state (see [`OptState`]).
    ///
    /// # Errors
    /// A candle error reading it.
    pub fn state(&self) -> candle_core::Result<OptState> {
        match self {
            Optim::Sgd(_) => Ok(OptState::Sgd),
            Optim::AdamW(o) => o.state(),
        }
    }

    /// Overwrites its state.
    ///
    /// # Errors
    /// A candle error when `state` belongs to another kind of optimizer or has the wrong size.
    pub fn set_state(&mut self, state: &OptState) -> candle_core::Result<()> {
        match (self, state) {
            (Optim::Sgd(_), OptState::Sgd) => Ok(()),
            (Optim::AdamW(o), OptState::AdamW { step, m, v }) => o.set_state(*step, m, v),
            (o, s) => candle_core::bail!(
                "{} state for a {} optimizer",
                s.kind().name(),
                o.kind().name()
            ),
        }
    }
}

/// `Config` is the kind and the learning rate (see [`Optim::new`]).
impl Optimizer for Optim {
    type Config = (OptimizerKind, f64);

    fn new(vars: Vec<Var>, (kind, lr): (OptimizerKind, f64)) -> candle_core::Result<Self> {
        Optim::new(kind, vars, lr)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        match self {
            Optim::Sgd(o) => o.step(grads),
            Optim::AdamW(o) => o.step(grads),
        }
    }

    fn learning_rate(&self) -> f64 {
        match self {
            Optim::Sgd(o) => o.learning_rate(),
            Optim::AdamW(o) => o.learning_rate(),
        }
    }

    fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Optim::Sgd(o) => o.set_learning_rate(lr),
            Optim::AdamW(o) => o.set_learning_rate(lr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::SplitMix64;
    use crate::model::{Mlp, digits_widths};

    fn grads(n: usize, seed: u64) -> Vec<f32> {
        let mut r = SplitMix64::new(seed);
        (0..n).map(|_| r.next_f32() - 0.5).collect()
    }

    #[test]
    fn adamw_is_candle_nns_adamw_bit_for_bit() {
        let (a, b) = (
            Mlp::new(&digits_widths(6), 1).unwrap(),
            Mlp::new(&digits_widths(6), 1).unwrap(),
        );
        let p = ParamsAdamW {
            lr: 0.01,
            ..ParamsAdamW::default()
        };
        let mut ours = AdamW::new(a.vars.clone(), p.clone()).unwrap();
        let mut theirs = candle_nn::AdamW::new(b.vars.clone(), p).unwrap();
        for s in 0..5 {
            let g = grads(a.param_count(), s);
            a.apply(&mut ours, &g).unwrap();
            b.apply(&mut theirs, &g).unwrap();
            assert_eq!(
                a.flat_params().unwrap(),
                b.flat_params().unwrap(),
                "step {s}"
            );
        }
        // And it moved: not a no-op on both sides.
        assert_ne!(
            a.flat_params().unwrap(),
            Mlp::new(&digits_widths(6), 1)
                .unwrap()
                .flat_params()
                .unwrap()
        );
    }

    #[test]
    fn adamw_state_restores_the_trajectory() {
        let w = digits_widths(5);
        let (a, b) = (Mlp::new(&w, 2).unwrap(), Mlp::new(&w, 2).unwrap());
        let mut oa = Optim::new(OptimizerKind::AdamW, a.vars.clone(), 0.01).unwrap();
        let n = a.param_count();
        for s in 0..3 {
            a.apply(&mut oa, &grads(n, s)).unwrap();
        }
        let st = oa.state().unwrap();
        let OptState::AdamW { step, m, v } = &st else {
            panic!("{st:?}")
        };
        assert_eq!((*step, m.len(), v.len()), (3, n, n));
        assert!(m.iter().any(|x| *x != 0.0) && v.iter().all(|x| *x >= 0.0));
        // A fresh optimizer given the parameters and the state continues identically; without
        // the state (moments zero, step 0) it does not.
        b.set_flat_params(&a.flat_params().unwrap()).unwrap();
        let mut ob = Optim::new(OptimizerKind::AdamW, b.vars.clone(), 0.01).unwrap();
        let c = Mlp::new(&w, 2).unwrap();
        c.set_flat_params(&a.flat_params().unwrap()).unwrap();
        let mut oc = Optim::new(OptimizerKind::AdamW, c.vars.clone(), 0.01).unwrap();
        ob.set_state(&st).unwrap();
        for s in 3..5 {
            a.apply(&mut oa, &grads(n, s)).unwrap();
            b.apply(&mut ob, &grads(n, s)).unwrap();
            c.apply(&mut oc, &grads(n, s)).unwrap();
        }
        assert_eq!(a.flat_params().unwrap(), b.flat_params().unwrap());
        assert_eq!(oa.state().unwrap(), ob.state().unwrap());
        assert_ne!(a.flat_params().unwrap(), c.flat_params().unwrap());
        // State of another kind or size is refused.
        assert!(ob.set_state(&OptState::Sgd).is_err());
        let short = OptState::AdamW {
            step: 1,
            m: vec![0.0; n - 1],
            v: vec![0.0; n - 1],
        };
        assert!(ob.set_state(&short).is_err());
    }
}
