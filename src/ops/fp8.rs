//! # FP8: eight bits a number, and a scale that makes them enough
//!
//! An H100's FP8 tensor cores multiply twice as fast as its bf16 ones, and an FP8 matrix is half
//! the bytes. Two 8-bit formats share the work (OCP FP8; NVIDIA's `__nv_fp8_e4m3`, `__nv_fp8_e5m2`):
//!
//! ```text
//!          sign exponent mantissa  largest   smallest normal  smallest subnormal  unit roundoff u
//! E4M3     1    4 (bias 7)  3       448       2⁻⁶              2⁻⁹                 2⁻⁴ = 6.25%
//! E5M2     1    5 (bias 15) 2       57344     2⁻¹⁴             2⁻¹⁶                2⁻³ = 12.5%
//! bf16     1    8 (bias 127) 7      3.4e38    2⁻¹²⁶            2⁻¹³³               2⁻⁸ = 0.39%
//! ```
//! (E4M3 gives up infinity, and all but one NaN pattern, for one more binade: its largest is 448,
//! not 240.) E4M3 has the precision and E5M2 the range: weights and activations go in E4M3,
//! gradients, whose magnitudes spread wider, in E5M2 (TransformerEngine's "hybrid" recipe).
//!
//! **Why a scale.** Seventeen binades (E4M3) cannot hold a tensor as it comes: activations of
//! size 30 and gradients of size 1e-7 would overflow or flush to zero. So each tensor is cast as
//! `q = fp8(x · s)` with its own scale s, and every product of two cast tensors is multiplied
//! back by `1 / (s_a · s_b)` as the GEMM writes its output. **Current scaling** takes s from the
//! tensor itself at the moment it is cast: s = largest / amax(|x|), rounded down to a power of two,
//! so that its largest element lands in the format's top binade and nothing overflows, whatever
//! the step did to the tensor. (A power of two costs at most that one binade of range and buys
//! exactness: multiplying by s or 1/s only moves exponents, so the cast is the only rounding, and
//! a weight cast once, decoded and cast again gives back the same bytes: `ops/packing.rs` counts on
//! it. MXFP8's block scales are powers of two for the same reason.)
//! (Delayed scaling guesses s from the amax of earlier steps, saving a pass over the tensor, and
//! overflows when a tensor grows faster than its history: one reason current scaling won.) With
//! one scale per tensor, an element far below the amax loses bits (below amax · 2⁻¹⁷ in E4M3 it is
//! a subnormal or zero); finer scales (per row, per 128-block: "rowwise", MXFP8) trade that back.
//!
//! **Where the casts sit** (a linear layer y = x · Wᵀ; `ops::linear` and its two backward halves,
//! which read their operands as a `Precision` says: `ops/precision.rs`, FP8 one of them):
//!
//! ```text
//! forward    y  = (e4m3(x·sx) · e4m3(W·sw)ᵀ) / (sx·sw)        → bf16
//! backward   dx = (e5m2(dy·sg) · e4m3(W·sw)) / (sg·sw)        → bf16
//!            dW += (e5m2(dy·sg)ᵀ · e4m3(x·sx)) / (sg·sx)      → the fp32 gradient
//! ```
//! Every product of two FP8 numbers is exact in f32 and the sums run in f32; only the casts round.
//! Everything else stays as in bf16 mixed precision: master weights, gradients and the optimizer
//! in fp32, norms, attention, softmax and the loss on bf16 tensors. The layers that stay out of
//! FP8: the output layer (its logits feed the softmax directly: torchtitan and TransformerEngine
//! recipes keep it in bf16) and a mixture of experts' router (tiny, and its top-k is a discrete
//! choice a rounding could flip).
//!
//! **Why training survives.** Each cast rounds an element by at most u of itself, and on average
//! by much less: for numbers spread over their binade as Benford's law says, the error's root mean
//! square is r = 0.212·2⁻ᵐ of the number (2.65% in E4M3, 5.31% in E5M2). A sum of K products whose
//! errors are independent errs by about r·√K of a typical term, against the sum's own size of
//! about √K of a term (random signs): the GEMM's output errs by √(r_a² + r_b²) of itself, 3.75%
//! for E4M3 × E4M3 and 5.94% for E5M2 × E4M3 (`tests/fp8.rs` states and checks these, and the
//! worst case). The noise is fresh each step, not a bias, and smaller than the noise of sampling
//! the batch, which SGD already averages out.
//!
//! The CPU computes this in f32, rounding exactly as the GPU does (round to nearest even,
//! saturating at the largest value, as `__NV_SATFINITE`): the CPU run shows what FP8 does to the
//! curve, and the GPU path (`ops/gpu_fp8.rs`: cast kernels and a cuBLASLt FP8 GEMM) is checked
//! against it.

/// One of the two FP8 formats.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fp8 {
    /// 4 exponent bits, 3 of mantissa: weights and activations.
    E4M3,
    /// 5 exponent bits, 2 of mantissa: gradients.
    E5M2,
}

impl Fp8 {
    /// The largest finite value.
    pub fn largest(self) -> f32 {
        match self {
            Fp8::E4M3 => 448.0,
            Fp8::E5M2 => 57344.0,
        }
    }

    /// The byte of `round(x)`: sign, exponent (bias 7 or 15), mantissa; NaN for NaN (0x7f).
    pub fn encode(self, x: f32) -> u8 {
        let r = self.round(x);
        if r.is_nan() {
            return 0x7f;
        }
        let ((m, e_min), a) = (self.bits(), r.abs());
        let code = if a < (2.0f32).powi(e_min) {
            (a / self.subnormal_step()) as u32 // a subnormal: a count of subnormal steps
        } else {
            let b = a.to_bits();
            ((((b >> 23) & 0xff) as i32 - 127 + self.bias()) as u32) << m | (b >> (23 - m)) & ((1 << m) - 1)
        };
        (if r.is_sign_negative() { 0x80 } else { 0 }) | code as u8
    }

    /// The value of a byte `encode` wrote.
    pub fn decode(self, byte: u8) -> f32 {
        let (m, _) = self.bits();
        let (e, frac) = (((byte & 0x7f) >> m) as i32, (byte & ((1 << m) - 1)) as f32 / (1 << m) as f32);
        let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
        match (self, e) {
            (Fp8::E4M3, 15) if byte & 0x7f == 0x7f => f32::NAN,
            (Fp8::E5M2, 31) => f32::NAN, // ∞ and NaN: never written (saturating casts)
            (_, 0) => sign * frac * (2.0f32).powi(1 - self.bias()),
            _ => sign * (1.0 + frac) * (2.0f32).powi(e - self.bias()),
        }
    }

    fn bias(self) -> i32 {
        match self {
            Fp8::E4M3 => 7,
            Fp8::E5M2 => 15,
        }
    }

    /// Mantissa bits, and the exponent of the smallest normal number.
    fn bits(self) -> (i32, i32) {
        match self {
            Fp8::E4M3 => (3, -6),
            Fp8::E5M2 => (2, -14),
        }
    }

    /// The unit roundoff: a rounded normal number is within this share of itself.
    pub fn unit_roundoff(self) -> f32 {
        (2.0f32).powi(-self.bits().0 - 1)
    }

    /// The spacing of the subnormals: a number below the smallest normal is within half of it.
    pub fn subnormal_step(self) -> f32 {
        let (m, e_min) = self.bits();
        (2.0f32).powi(e_min - m)
    }

    /// `x` rounded to the nearest value of this format, ties to even; beyond the largest value,
    /// the largest (saturating); not a number for NaN and ±∞ (an overflow upstream stays seen).
    pub fn round(self, x: f32) -> f32 {
        if !x.is_finite() {
            return f32::NAN;
        }
        let (m, e_min) = self.bits();
        // the spacing of the format's numbers around |x|: 2^(exponent − m), never below the
        // subnormals'; a power of two, so x / step and back are exact in f32
        let e = (((x.to_bits() >> 23) & 0xff) as i32 - 127).max(e_min) - m; // step = 2^e
        let (step, inverse) = (f32::from_bits(((127 + e) as u32) << 23), f32::from_bits(((127 - e) as u32) << 23));
        // |x / step| < 2^(m + 2): adding 1.5·2²³ leaves no bits below the units, so f32's own
        // rounding (to nearest, ties to even) rounds it; the subtraction is then exact
        const ROUND: f32 = 12582912.0;
        let r = ((x * inverse + ROUND) - ROUND) * step;
        r.clamp(-self.largest(), self.largest())
    }
}

/// The scale current scaling gives a tensor of this amax: the power of two that puts its
/// largest magnitude in the format's top binade, largest / amax rounded down (1 for an all-zero
/// or non-finite tensor; at most 2¹²⁷ for a tiny one). `kernels/fp8.cu` computes the same.
pub fn scale_for(amax: f32, f: Fp8) -> f32 {
    if !(amax > 0.0 && amax.is_finite()) {
        return 1.0;
    }
    let s = (f.largest() / amax).min(f32::from_bits(254 << 23)); // 2¹²⁷
    f32::from_bits(s.to_bits() & 0xff80_0000) // the mantissa dropped: a power of two
}
