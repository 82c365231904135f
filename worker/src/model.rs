//! The classifiers (multi-layer perceptrons in candle, CPU): the digits MLP and the synthetic
//! bandwidth model, their gradients as flat `f32` vectors, and the fusion of all gradients into
//! the one buffer a training step allreduces.
//!
//! An [`Mlp`] is given by its layer widths `[input, hidden…, classes]`: the digits model is
//! [`digits_widths`] (`64 → hidden → 10`), the synthetic one [`synthetic_widths`] (a deep MLP
//! sized to a requested parameter count). Parameters, in this fixed order (the order of
//! [`Mlp::vars`], of the fused buffer and of the checkpoint's tensors), for layer `i` in
//! `1..=layers`: `fc<i>.weight` `[widths[i], widths[i-1]]`, `fc<i>.bias` `[widths[i]]`
//! ([`param_names`], [`param_shapes`]).

use candle_core::{DType, Device, Tensor, Var};

use crate::data::{CLASSES, Dataset, FEATURES, SplitMix64};

/// Inputs per sample of the synthetic model's data.
pub const SYNTHETIC_FEATURES: usize = 256;
/// Classes of the synthetic model's data.
pub const SYNTHETIC_CLASSES: usize = 16;

/// Widths of the digits MLP with `hidden` units: `[64, hidden, 10]`.
pub fn digits_widths(hidden: usize) -> Vec<usize> {
    vec![FEATURES, hidden, CLASSES]
}

/// Parameters of an MLP with these widths: `Σ (widths[i-1] + 1) · widths[i]`.
pub fn count_params(widths: &[usize]) -> usize {
    widths.windows(2).map(|w| (w[0] + 1) * w[1]).sum()
}

/// Widths of the synthetic model: [`SYNTHETIC_FEATURES`] inputs, `layers` hidden layers of one
/// width `h`, [`SYNTHETIC_CLASSES`] outputs, with `h` the width whose parameter count
/// ([`count_params`]) is closest to `params`. With `L = layers`, `F` inputs and `C` classes the
/// count is `(L-1)·h² + (F + L + C)·h + C`, solved for `h` and rounded (at least 1). E.g.
/// `params` 20,000,000 and 4 layers give `h` = 2536, 19,993,840 parameters.
///
/// # Panics
/// When `layers` is 0.
pub fn synthetic_widths(params: usize, layers: usize) -> Vec<usize> {
    assert!(layers > 0, "at least one hidden layer");
    let (f, c, l) = (
        SYNTHETIC_FEATURES as f64,
        SYNTHETIC_CLASSES as f64,
        layers as f64,
    );
    let (a, b, k) = (l - 1.0, f + l + c, c - params as f64);
    let h = if a == 0.0 {
        -k / b
    } else {
        (-b + (b * b - 4.0 * a * k).sqrt()) / (2.0 * a)
    };
    let shape = |h: usize| {
        let mut w = vec![SYNTHETIC_FEATURES];
        w.extend(std::iter::repeat_n(h, layers));
        w.push(SYNTHETIC_CLASSES);
        w
    };
    // The real root, then the closer of its two integer neighbours.
    let lo = (h.floor().max(1.0)) as usize;
    let gap = |h: usize| count_params(&shape(h)).abs_diff(params);
    shape(if gap(lo + 1) < gap(lo) { lo + 1 } else { lo })
}

/// Names of the parameters of an MLP of `layers` layers (`widths.len() - 1`), in order:
/// `fc1.weight`, `fc1.bias`, `fc2.weight`, …
pub fn param_names(layers: usize) -> Vec<String> {
    (1..=layers)
        .flat_map(|i| [format!("fc{i}.weight"), format!("fc{i}.bias")])
        .collect()
}

/// The shapes of the parameters of an MLP with these widths, in [`param_names`] order.
pub fn param_shapes(widths: &[usize]) -> Vec<Vec<usize>> {
    widths
        .windows(2)
        .flat_map(|w| [vec![w[1], w[0]], vec![w[1]]])
        .collect()
}

/// An MLP `widths[0] → … → widths[last]` with ReLU between layers (none after the last);
/// parameters are candle [`Var`]s on the CPU.
#[derive(Debug)]
pub struct Mlp {
    /// The parameters, in [`param_names`] order.
    pub vars: Vec<Var>,
    widths: Vec<usize>,
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
    /// A fresh MLP with these layer widths (at least two), initialised deterministically from
    /// `seed`: weights and biases uniform in `±1/√fan_in` (PyTorch's `nn.Linear` default), drawn
    /// from [`SplitMix64`] in parameter order.
    ///
    /// # Errors
    /// A candle error creating the tensors, or fewer than two widths.
    pub fn new(widths: &[usize], seed: u64) -> candle_core::Result<Mlp> {
        if widths.len() < 2 {
            candle_core::bail!("an MLP needs at least two widths, got {widths:?}");
        }
        let mut rng = SplitMix64::new(seed ^ 0x6D6C_7069_6E69_7400);
        // Each shape with the fan-in of its layer (weight and bias of layer i: widths[i-1]).
        let fans = widths[..widths.len() - 1].iter().flat_map(|&f| [f, f]);
        let vars = param_shapes(widths)
            .iter()
            .zip(fans)
            .map(|(s, fan)| {
                let bound = 1.0 / (fan as f32).sqrt();
                let n: usize = s.iter().product();
                let v: Vec<f32> = (0..n)
                    .map(|_| (rng.next_f32() * 2.0 - 1.0) * bound)
                    .collect();
                Var::from_tensor(&Tensor::from_vec(v, s.as_slice(), &Device::Cpu)?)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Mlp {
            vars,
            widths: widths.to_vec(),
        })
    }

    /// The layer widths `[input, hidden…, classes]`.
    pub fn widths(&self) -> &[usize] {
        &self.widths
    }

    /// Element counts of the parameters, in order.
    pub fn lens(&self) -> Vec<usize> {
        self.vars.iter().map(|v| v.elem_count()).collect()
    }

    /// Total number of parameters.
    pub fn param_count(&self) -> usize {
        self.lens().iter().sum()
    }

    /// Logits `[n, classes]` of inputs `x` `[n, widths[0]]`.
    ///
    /// # Errors
    /// A candle error (shape mismatch).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let layers = self.vars.len() / 2;
        let mut h = x.clone();
        for (i, wb) in self.vars.chunks_exact(2).enumerate() {
            h = h
                .matmul(&wb[0].as_tensor().t()?)?
                .broadcast_add(wb[1].as_tensor())?;
            if i + 1 < layers {
                h = h.relu()?;
            }
        }
        Ok(h)
    }

    /// The inputs of `d` as a tensor `[len, widths[0]]`.
    fn inputs(&self, d: &Dataset) -> candle_core::Result<Tensor> {
        if d.features != self.widths[0] {
            candle_core::bail!(
                "samples of {} inputs for a model of {} inputs",
                d.features,
                self.widths[0]
            );
        }
        Tensor::from_slice(&d.x, (d.len(), d.features), &Device::Cpu)
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
    /// A candle error, e.g. when the samples do not have `widths[0]` inputs.
    pub fn grad_sum(&self, d: &Dataset) -> candle_core::Result<(Vec<Vec<f32>>, f32)> {
        if d.is_empty() {
            return Ok((self.lens().iter().map(|&n| vec![0.0; n]).collect(), 0.0));
        }
        let x = self.inputs(d)?;
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
        opt.step(&self.grad_store(flat)?)
    }

    /// The gradients `flat` (in parameter order) as the `GradStore` optimizers take.
    ///
    /// # Errors
    /// A candle error (wrong length).
    pub fn grad_store(
        &self,
        flat: &[f32],
    ) -> candle_core::Result<candle_core::backprop::GradStore> {
        if flat.len() != self.param_count() {
            candle_core::bail!(
                "{} gradients for {} parameters",
                flat.len(),
                self.param_count()
            );
        }
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
        Ok(store)
    }

    /// Fraction of `d` classified correctly, in `[0, 1]`.
    ///
    /// # Errors
    /// A candle error.
    pub fn accuracy(&self, d: &Dataset) -> candle_core::Result<f64> {
        if d.is_empty() {
            return Ok(0.0);
        }
        let x = self.inputs(d)?;
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
        let w = digits_widths(8);
        let m = Mlp::new(&w, 1).unwrap();
        assert_eq!(m.param_count(), 8 * 64 + 8 + 10 * 8 + 10);
        assert_eq!(m.param_count(), count_params(&w));
        let p = m.flat_params().unwrap();
        assert_eq!(p, Mlp::new(&w, 1).unwrap().flat_params().unwrap());
        assert_ne!(p, Mlp::new(&w, 2).unwrap().flat_params().unwrap());
        let z = vec![0.5; p.len()];
        m.set_flat_params(&z).unwrap();
        assert_eq!(m.flat_params().unwrap(), z);
        assert!(m.set_flat_params(&z[1..]).is_err());
    }

    #[test]
    fn summed_gradients_add_up_over_shards() {
        let m = Mlp::new(&digits_widths(8), 3).unwrap();
        let mut rng = SplitMix64::new(5);
        let d = Dataset {
            x: (0..6 * FEATURES).map(|_| rng.next_f32()).collect(),
            y: vec![0, 1, 2, 3, 4, 5],
            features: FEATURES,
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
        let m = Mlp::new(&digits_widths(4), 3).unwrap();
        let before = m.flat_params().unwrap();
        let mut opt = <candle_nn::SGD as candle_nn::Optimizer>::new(m.vars.clone(), 0.5).unwrap();
        let g: Vec<f32> = (0..before.len()).map(|i| i as f32 * 0.01).collect();
        m.apply(&mut opt, &g).unwrap();
        let after = m.flat_params().unwrap();
        for i in 0..g.len() {
            assert!((after[i] - (before[i] - 0.5 * g[i])).abs() < 1e-6);
        }
    }

    #[test]
    fn synthetic_widths_hit_the_parameter_count() {
        let w = synthetic_widths(20_000_000, 4);
        assert_eq!(w, vec![256, 2536, 2536, 2536, 2536, 16]);
        assert_eq!(count_params(&w), 19_993_840);
        for (p, l) in [(50_000, 1), (1_000_000, 2), (30_000_000, 6)] {
            let w = synthetic_widths(p, l);
            assert_eq!(w.len(), l + 2);
            let got = count_params(&w) as f64;
            assert!((got / p as f64 - 1.0).abs() < 0.01, "{p} {l}: {got}");
        }
        // A small deep model runs forward and backward with the synthetic data.
        let w = synthetic_widths(100_000, 3);
        let m = Mlp::new(&w, 1).unwrap();
        let d = crate::data::synthetic(5, SYNTHETIC_FEATURES, SYNTHETIC_CLASSES, 1);
        let (g, loss) = m.grad_sum(&d).unwrap();
        assert_eq!(fuse(&g, &[]).len(), m.param_count());
        assert!(loss > 0.0);
        assert_eq!(m.forward(&m.inputs(&d).unwrap()).unwrap().dims(), [5, 16]);
        // Samples of the wrong width are refused, not misread.
        let digit = Dataset {
            x: vec![0.5; FEATURES],
            y: vec![1],
            features: FEATURES,
        };
        assert!(m.grad_sum(&digit).is_err());
    }
}
