//! The digits classifier (a two-layer MLP in candle, CPU), its gradients as flat `f32` vectors,
//! and the fusion of all gradients into the one buffer a training step allreduces.
//!
//! Parameters, in this fixed order (the order of [`Mlp::vars`], of the fused buffer and of the
//! checkpoint's tensors): `fc1.weight` `[hidden, 64]`, `fc1.bias` `[hidden]`, `fc2.weight`
//! `[10, hidden]`, `fc2.bias` `[10]`.

use candle_core::{DType, Device, Tensor, Var};

use crate::data::{CLASSES, Dataset, FEATURES, SplitMix64};

/// Names of the parameters, in order.
pub const PARAM_NAMES: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

/// The shapes of the parameters of an MLP with `hidden` units, in [`PARAM_NAMES`] order.
pub fn param_shapes(hidden: usize) -> [Vec<usize>; 4] {
    [
        vec![hidden, FEATURES],
        vec![hidden],
        vec![CLASSES, hidden],
        vec![CLASSES],
    ]
}

/// `64 → hidden (ReLU) → 10` classifier; parameters are candle [`Var`]s on the CPU.
#[derive(Debug)]
pub struct Mlp {
    /// The parameters, in [`PARAM_NAMES`] order.
    pub vars: Vec<Var>,
    hidden: usize,
}

/// The concatenation of `parts`, then `extra` (e.g. the loss), as one buffer.
pub fn fuse(parts: &[Vec<f32>], extra: &[f32]) -> Vec<f32> {
    let n = parts.iter().map(Vec::len).sum::<usize>() + extra.len();
    let mut out = Vec::with_capacity(n);
    for p in parts {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(extra);
    out
}

/// Splits `buf` into consecutive slices of `lens`; the remainder (the `extra` of [`fuse`]) is the
/// last element of the result.
///
/// # Panics
/// When `lens` add up to more than `buf.len()`.
pub fn unfuse<'a>(buf: &'a [f32], lens: &[usize]) -> Vec<&'a [f32]> {
    let mut out = Vec::with_capacity(lens.len() + 1);
    let mut rest = buf;
    for &l in lens {
        let (a, b) = rest.split_at(l);
        out.push(a);
        rest = b;
    }
    out.push(rest);
    out
}

impl Mlp {
    /// A fresh MLP, initialised deterministically from `seed`: weights and biases uniform in
    /// `±1/√fan_in` (PyTorch's `nn.Linear` default), drawn from [`SplitMix64`].
    ///
    /// # Errors
    /// A candle error creating the tensors.
    pub fn new(hidden: usize, seed: u64) -> candle_core::Result<Mlp> {
        let mut rng = SplitMix64::new(seed ^ 0x6D6C_7069_6E69_7400);
        let shapes = param_shapes(hidden);
        let fan_in = [FEATURES, FEATURES, hidden, hidden];
        let vars = shapes
            .iter()
            .zip(fan_in)
            .map(|(s, fan)| {
                let bound = 1.0 / (fan as f32).sqrt();
                let n: usize = s.iter().product();
                let v: Vec<f32> = (0..n)
                    .map(|_| (rng.next_f32() * 2.0 - 1.0) * bound)
                    .collect();
                Var::from_tensor(&Tensor::from_vec(v, s.as_slice(), &Device::Cpu)?)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Mlp { vars, hidden })
    }

    /// Hidden units.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Element counts of the parameters, in order.
    pub fn lens(&self) -> Vec<usize> {
        self.vars.iter().map(|v| v.elem_count()).collect()
    }

    /// Total number of parameters.
    pub fn param_count(&self) -> usize {
        self.lens().iter().sum()
    }

    /// Logits `[n, 10]` of images `x` `[n, 64]`.
    ///
    /// # Errors
    /// A candle error (shape mismatch).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let v = |i: usize| self.vars[i].as_tensor();
        let h = x.matmul(&v(0).t()?)?.broadcast_add(v(1))?.relu()?;
        h.matmul(&v(2).t()?)?.broadcast_add(v(3))
    }

    /// All parameters, flattened and concatenated in order.
    ///
    /// # Errors
    /// A candle error reading them.
    pub fn flat_params(&self) -> candle_core::Result<Vec<f32>> {
        let parts = self
            .vars
            .iter()
            .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(fuse(&parts, &[]))
    }

    /// Overwrites all parameters from `flat` (as produced by [`Mlp::flat_params`]).
    ///
    /// # Errors
    /// A candle error when `flat` has the wrong length.
    pub fn set_flat_params(&self, flat: &[f32]) -> candle_core::Result<()> {
        if flat.len() != self.param_count() {
            candle_core::bail!(
                "{} parameters given, the model has {}",
                flat.len(),
                self.param_count()
            );
        }
        for (v, part) in self.vars.iter().zip(unfuse(flat, &self.lens())) {
            v.set(&Tensor::from_slice(part, v.shape(), &Device::Cpu)?)?;
        }
        Ok(())
    }

    /// Gradients of the **summed** cross-entropy over the samples of `d` (flattened, in
    /// parameter order) and that sum. Summing rather than averaging weights each rank by its
    /// sample count, so the allreduced sum divided by the global batch is the global mean
    /// gradient. An empty `d` gives zero gradients and a zero loss.
    ///
    /// # Errors
    /// A candle error.
    pub fn grad_sum(&self, d: &Dataset) -> candle_core::Result<(Vec<Vec<f32>>, f32)> {
        if d.is_empty() {
            return Ok((self.lens().iter().map(|&n| vec![0.0; n]).collect(), 0.0));
        }
        let x = Tensor::from_slice(&d.x, (d.len(), FEATURES), &Device::Cpu)?;
        let y = Tensor::from_slice(&d.y, d.len(), &Device::Cpu)?;
        let lsm = candle_nn::ops::log_softmax(&self.forward(&x)?, 1)?;
        let loss = lsm.gather(&y.unsqueeze(1)?, 1)?.sum_all()?.neg()?;
        let grads = loss.backward()?;
        let parts = self
            .vars
            .iter()
            .map(|v| match grads.get(v.as_tensor()) {
                Some(g) => g.flatten_all()?.to_vec1::<f32>(),
                None => Ok(vec![0.0; v.elem_count()]),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok((parts, loss.to_scalar::<f32>()?))
    }

    /// Applies one step of `opt` with the gradients `flat` (in parameter order).
    ///
    /// # Errors
    /// A candle error (wrong length).
    pub fn apply<O: candle_nn::Optimizer>(
        &self,
        opt: &mut O,
        flat: &[f32],
    ) -> candle_core::Result<()> {
        // A GradStore can only come from `backward`: take one of zeros, then set every gradient.
        let zero = self
            .vars
            .iter()
            .map(|v| v.as_tensor().sum_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut store = Tensor::stack(&zero, 0)?
            .sum_all()?
            .affine(0.0, 0.0)?
            .backward()?;
        for (v, g) in self.vars.iter().zip(unfuse(flat, &self.lens())) {
            store.insert(
                v.as_tensor(),
                Tensor::from_slice(g, v.shape(), &Device::Cpu)?,
            );
        }
        opt.step(&store)
    }

    /// Fraction of `d` classified correctly, in `[0, 1]`.
    ///
    /// # Errors
    /// A candle error.
    pub fn accuracy(&self, d: &Dataset) -> candle_core::Result<f64> {
        if d.is_empty() {
            return Ok(0.0);
        }
        let x = Tensor::from_slice(&d.x, (d.len(), FEATURES), &Device::Cpu)?;
        let pred = self.forward(&x)?.argmax(1)?.to_dtype(DType::U32)?;
        let pred = pred.to_vec1::<u32>()?;
        let right = pred.iter().zip(&d.y).filter(|(a, b)| a == b).count();
        Ok(right as f64 / d.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_then_unfuse_is_identity() {
        let parts = vec![vec![1.0, 2.0], vec![], vec![3.0]];
        let buf = fuse(&parts, &[9.0]);
        assert_eq!(buf, vec![1.0, 2.0, 3.0, 9.0]);
        let back = unfuse(&buf, &[2, 0, 1]);
        assert_eq!(back, vec![&[1.0, 2.0][..], &[], &[3.0], &[9.0]]);
    }

    #[test]
    fn flat_params_roundtrip_and_init_is_seeded() {
        let m = Mlp::new(8, 1).unwrap();
        assert_eq!(m.param_count(), 8 * 64 + 8 + 10 * 8 + 10);
        let p = m.flat_params().unwrap();
        assert_eq!(p, Mlp::new(8, 1).unwrap().flat_params().unwrap());
        assert_ne!(p, Mlp::new(8, 2).unwrap().flat_params().unwrap());
        let z = vec![0.5; p.len()];
        m.set_flat_params(&z).unwrap();
        assert_eq!(m.flat_params().unwrap(), z);
        assert!(m.set_flat_params(&z[1..]).is_err());
    }

    #[test]
    fn summed_gradients_add_up_over_shards() {
        let m = Mlp::new(8, 3).unwrap();
        let mut rng = SplitMix64::new(5);
        let d = Dataset {
            x: (0..6 * FEATURES).map(|_| rng.next_f32()).collect(),
            y: vec![0, 1, 2, 3, 4, 5],
        };
        let (whole, loss) = m.grad_sum(&d).unwrap();
        let (a, la) = m.grad_sum(&d.gather(&[0, 1])).unwrap();
        let (b, lb) = m.grad_sum(&d.gather(&[2, 3, 4, 5])).unwrap();
        let (e, le) = m.grad_sum(&d.gather(&[])).unwrap();
        assert_eq!(le, 0.0);
        assert!((loss - la - lb).abs() < 1e-4);
        let (whole, a, b, e) = (
            fuse(&whole, &[]),
            fuse(&a, &[]),
            fuse(&b, &[]),
            fuse(&e, &[]),
        );
        for i in 0..whole.len() {
            assert!((whole[i] - a[i] - b[i] - e[i]).abs() < 1e-5, "{i}");
        }
    }

    #[test]
    fn apply_is_sgd() {
        let m = Mlp::new(4, 3).unwrap();
        let before = m.flat_params().unwrap();
        let mut opt = <candle_nn::SGD as candle_nn::Optimizer>::new(m.vars.clone(), 0.5).unwrap();
        let g: Vec<f32> = (0..before.len()).map(|i| i as f32 * 0.01).collect();
        m.apply(&mut opt, &g).unwrap();
        let after = m.flat_params().unwrap();
        for i in 0..g.len() {
            assert!((after[i] - (before[i] - 0.5 * g[i])).abs() < 1e-6);
        }
    }
}
