//! Element types and reduction kernels.
//!
//! Owns the arithmetic only (no I/O): `dst = (dst + src)·scale`, `max(dst, src)` and
//! `min(dst, src)` over slices of one element type. `f64` adds in `f64`, `i32`/`i64` add with
//! wrap-around (as two's-complement hardware and torch's gloo do).
//! `f32` adds in `f32`; `f16` and `bf16` travel on the wire in their own 2-byte formats (half the
//! bytes of `f32`) and are widened to `f32`, added, and rounded back to nearest-even once per
//! reduction. The loops work on fixed blocks so the compiler vectorises them; `f16` uses the
//! `half` crate's slice conversions (F16C when the CPU has it).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// The reduction applied by `allreduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size (the division is applied once, in `f32`,
    /// at the last reduction of each element). Only for `f32`, `f16` and `bf16`
    /// ([`DType::averages`]).
    Avg,
    /// Element-wise maximum (a NaN anywhere gives NaN).
    Max,
    /// Element-wise minimum (a NaN anywhere gives NaN).
    Min,
}

/// Data types on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE binary64.
    F64,
    /// Two's-complement 32-bit integer.
    I32,
    /// Two's-complement 64-bit integer.
    I64,
}

impl DType {
    /// Whether [`ReduceOp::Avg`] is defined for this type (the scale is an `f32`, so only for
    /// `f32` and the half types).
    pub fn averages(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for f64 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

/// An element type `allreduce` accepts: `f32`, `half::f16`, `half::bf16`, `f64`, `i32`, `i64`
/// (sealed).
///
/// Every bit pattern is a valid value and the types have no padding, so buffers can be moved
/// over the wire as raw little-endian bytes.
pub trait Element: sealed::Sealed + Copy + PartialOrd + Send + Sync + 'static {
    /// Wire type.
    const DTYPE: DType;
    /// `dst[i] = dst[i] + src[i]`, and then `·scale` when `scale` is given, accumulating in f32
    /// (in `f64` for `f64`; integers wrap and are never scaled: the communicator refuses
    /// [`ReduceOp::Avg`] for them). `dst` and `src` have the same length.
    fn reduce(dst: &mut [Self], src: &[Self], scale: Option<f32>);
    /// Converts from f32 (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// Converts to f32 (exact).
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn reduce(dst: &mut [f32], src: &[f32], scale: Option<f32>) {
        assert_eq!(dst.len(), src.len());
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { x86::f32_reduce(dst, src, scale) };
        }
        f32_reduce_portable(dst, src, scale)
    }
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

#[inline(always)]
fn f32_reduce_portable(dst: &mut [f32], src: &[f32], scale: Option<f32>) {
    match scale {
        None => dst.iter_mut().zip(src).for_each(|(d, s)| *d += *s),
        Some(k) => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = (*d + *s) * k),
    }
}

#[inline(always)]
fn bf16_reduce_portable(dst: &mut [bf16], src: &[bf16], scale: Option<f32>) {
    // Straight-line widen/add/round on bit patterns: vectorises without intrinsics.
    let k = scale.unwrap_or(1.0);
    for (d, s) in dst.iter_mut().zip(src) {
        let sum = (bf16_widen(d.to_bits()) + bf16_widen(s.to_bits())) * k;
        *d = bf16::from_bits(bf16_round(sum));
    }
}

fn f16_reduce_portable(dst: &mut [f16], src: &[f16], scale: Option<f32>) {
    let mut a = [0f32; BLOCK];
    let mut b = [0f32; BLOCK];
    for (d, s) in dst.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let (a, b) = (&mut a[..d.len()], &mut b[..d.len()]);
        d.convert_to_f32_slice(a);
        s.convert_to_f32_slice(b);
        f32_reduce_portable(a, b, scale);
        d.convert_from_f32_slice(a);
    }
}

/// The same kernels compiled for AVX2 (and F16C for `f16`), chosen at run time: the portable
/// build targets baseline x86-64 (SSE2, no half-float conversions).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{bf16, bf16_reduce_portable, f16, f16_reduce_portable, f32_reduce_portable};
    use std::arch::x86_64::{
        _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128, _mm256_add_ps,
        _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_mul_ps, _mm256_set1_ps,
    };

    #[target_feature(enable = "avx2")]
    pub(super) fn f32_reduce(dst: &mut [f32], src: &[f32], scale: Option<f32>) {
        f32_reduce_portable(dst, src, scale)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn bf16_reduce(dst: &mut [bf16], src: &[bf16], scale: Option<f32>) {
        bf16_reduce_portable(dst, src, scale)
    }

    /// 8 lanes at a time through `vcvtph2ps`/`vcvtps2ph` (round to nearest even, as
    /// `f16::from_f32`); the tail goes through the portable kernel.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn f16_reduce(dst: &mut [f16], src: &[f16], scale: Option<f32>) {
        let n = dst.len().min(src.len());
        let k = _mm256_set1_ps(scale.unwrap_or(1.0));
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i+8 ≤ n, so both 16-byte loads and the store stay inside the slices;
            // unaligned loads/stores are used.
            unsafe {
                let a = _mm256_cvtph_ps(_mm_loadu_si128(dst.as_ptr().add(i).cast()));
                let b = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i).cast()));
                let mut sum = _mm256_add_ps(a, b);
                if scale.is_some() {
                    sum = _mm256_mul_ps(sum, k);
                }
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(sum);
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
            }
            i += 8;
        }
        f16_reduce_portable(&mut dst[i..n], &src[i..n], scale);
    }
}

const BLOCK: usize = 512;

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn reduce(dst: &mut [f16], src: &[f16], scale: Option<f32>) {
        assert_eq!(dst.len(), src.len());
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
            // SAFETY: the CPU has AVX2 and F16C (checked above).
            return unsafe { x86::f16_reduce(dst, src, scale) };
        }
        f16_reduce_portable(dst, src, scale)
    }
    fn from_f32(x: f32) -> f16 {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

#[inline(always)]
fn bf16_widen(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

#[inline(always)]
fn bf16_round(f: f32) -> u16 {
    let b = f.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((b >> 16) as u16) | 0x0040;
    if f.is_nan() { quiet_nan } else { rounded }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn reduce(dst: &mut [bf16], src: &[bf16], scale: Option<f32>) {
        assert_eq!(dst.len(), src.len());
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { x86::bf16_reduce(dst, src, scale) };
        }
        bf16_reduce_portable(dst, src, scale)
    }
    fn from_f32(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// `f64` and the integers: plain loops the compiler vectorises (no half conversions).
impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn reduce(dst: &mut [f64], src: &[f64], scale: Option<f32>) {
        assert_eq!(dst.len(), src.len());
        let k = scale.map_or(1.0, f64::from);
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = (*d + *s) * k);
    }
    fn from_f32(x: f32) -> f64 {
        f64::from(x)
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
}

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn reduce(dst: &mut [$t], src: &[$t], _scale: Option<f32>) {
                assert_eq!(dst.len(), src.len());
                dst.iter_mut()
                    .zip(src)
                    .for_each(|(d, s)| *d = d.wrapping_add(*s));
            }
            /// Truncates toward zero, saturating at the type's bounds.
            fn from_f32(x: f32) -> $t {
                x as $t
            }
            /// Nearest f32 (exact up to 2^24).
            fn to_f32(self) -> f32 {
                self as f32
            }
        }
    };
}
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);

/// `dst[i] = max(dst[i], src[i])` (`max`) or the minimum (otherwise); a NaN in either gives
/// NaN, so the result does not depend on the order of the operands.
pub fn extreme<T: Element>(dst: &mut [T], src: &[T], max: bool) {
    assert_eq!(dst.len(), src.len());
    #[allow(clippy::eq_op)] // `s != s` is the NaN test of a generic PartialOrd type
    for (d, &s) in dst.iter_mut().zip(src) {
        let nan = s != s;
        if nan || (max && s > *d) || (!max && s < *d) {
            *d = s;
        }
    }
}

/// Views a slice of elements as its bytes.
pub fn as_bytes<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: T is a sealed plain number type: no padding, alignment ≥ 1, size_of_val bytes valid.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// Views a mutable slice of elements as its bytes.
pub fn as_bytes_mut<T: Element>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and every bit pattern written through the bytes is a valid T.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bf16_rounding_matches_half() {
        for x in [
            0.0f32,
            -0.0,
            1.0,
            1.003_906_2,
            1.011_718_8,
            3.4e38,
            f32::INFINITY,
            -7.5e-39,
            1e-45,
        ] {
            assert_eq!(bf16_round(x), bf16::from_f32(x).to_bits(), "{x}");
        }
        assert!(bf16::from_bits(bf16_round(f32::NAN)).is_nan());
    }

    fn check<T: Element + PartialEq + std::fmt::Debug>(a: &[f32], b: &[f32], scale: Option<f32>) {
        let mut d: Vec<T> = a.iter().map(|&x| T::from_f32(x)).collect();
        let s: Vec<T> = b.iter().map(|&x| T::from_f32(x)).collect();
        let want: Vec<T> = d
            .iter()
            .zip(&s)
            .map(|(x, y)| T::from_f32((x.to_f32() + y.to_f32()) * scale.unwrap_or(1.0)))
            .collect();
        T::reduce(&mut d, &s, scale);
        for (i, (g, w)) in d.iter().zip(&want).enumerate() {
            assert!(
                g == w || (g.to_f32().is_nan() && w.to_f32().is_nan()),
                "{i}: {g:?} != {w:?}"
            );
        }
    }

    #[test]
    fn extremes_propagate_nan_and_pick_by_order() {
        let mut d = [1.0f64, 5.0, f64::NAN, -0.5];
        extreme(&mut d, &[2.0, 4.0, 1.0, f64::NAN], true);
        assert_eq!(&d[..2], &[2.0, 5.0]);
        assert!(d[2].is_nan() && d[3].is_nan());
        let mut i = [3i64, -7, i64::MAX];
        extreme(&mut i, &[4, -9, 0], false);
        assert_eq!(i, [3, -9, 0]);
        let mut h = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        extreme(&mut h, &[bf16::from_f32(0.5), bf16::from_f32(-1.0)], true);
        assert_eq!(h, [bf16::from_f32(1.5), bf16::from_f32(-1.0)]);
    }

    #[test]
    fn integers_wrap_and_f64_adds_in_f64() {
        let mut i = [i32::MAX, 5];
        i32::reduce(&mut i, &[1, -7], None);
        assert_eq!(i, [i32::MIN, -2]);
        let mut d = [1e-17f64, 0.25];
        f64::reduce(&mut d, &[1.0, 0.25], Some(0.5));
        assert_eq!(d, [(1.0 + 1e-17) * 0.5, 0.25]);
    }

    proptest! {
        /// Each kernel equals the scalar definition: widen, add in f32, scale, round once.
        #[test]
        fn kernels_match_scalar_reference(
            v in proptest::collection::vec((-7e4f32..7e4, -7e4f32..7e4), 0..1500),
            avg in any::<bool>(),
        ) {
            let (a, b): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
            let scale = avg.then_some(0.25);
            check::<f32>(&a, &b, scale);
            check::<f16>(&a, &b, scale);
            check::<bf16>(&a, &b, scale);
            // and the portable kernels the SIMD ones are checked against
            let mut d: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
            let mut d2 = d.clone();
            let sh: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
            f16::reduce(&mut d, &sh, scale);
            f16_reduce_portable(&mut d2, &sh, scale);
            prop_assert!(d.iter().zip(&d2).all(|(x, y)| x == y || (x.is_nan() && y.is_nan())));
            let mut e: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
            let mut e2 = e.clone();
            let sb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
            bf16::reduce(&mut e, &sb, scale);
            bf16_reduce_portable(&mut e2, &sb, scale);
            prop_assert!(e.iter().zip(&e2).all(|(x, y)| x == y || (x.is_nan() && y.is_nan())));
        }
    }
}
