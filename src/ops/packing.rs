//! # Packing a weight for a gather: as its GEMMs read it
//!
//! ZeRO gathers every weight from its partitions (`parallel/zero.rs`; FSDP before each layer
//! computes), in the formats of `parallel/gather_formats.rs`. What travels need not be the fp32
//! master: a GEMM reading bf16 needs only bf16, and one reading FP8 only the FP8 bytes and the
//! scale. So a partition goes out in its weight's *packed format*, the GEMM's precision (`Precision`):
//! 4, 2 or 1 bytes a number, packed into f32 slots so that every backend and collective moves
//! them as plain f32 buffers, bit for bit:
//!
//! ```text
//! F32    one number a slot
//! Bf16   two bf16 numbers a slot (low half first)
//! Fp8    four FP8 bytes a slot (lowest byte first), E4M3 with current scaling
//! ```
//! FP8 needs one scale for the whole weight, not one per shard, or each rank's slice would be
//! cast differently from the others': each rank takes the maxima of its shard (`abs_max`), the
//! sharding group all-reduces them with max, and every rank casts with current scaling's s (a
//! power of two: `fp8::scale_for`) and decodes with 1/s. The decoded weight is e4m3(W · s) / s,
//! exactly, and the GEMM's own cast (the same amax, the same s) maps it back onto the same bytes:
//! gathering in FP8 changes no number a GEMM reads. (A GEMM could read the gathered bytes
//! directly, skipping one cast; here it casts again.)

use crate::cuda::device::fatal;
use crate::cuda::launch_table::NORM_BLOCKS;
use crate::ops::fp8::{scale_for, Fp8};
use crate::ops::tensor::Tensor;
use crate::ops::{gpu, Precision};

/// How many maxima `abs_max` gives: one per slice of the tensor (a GPU block's each).
pub const MAXIMA: usize = NORM_BLOCKS;

/// The f32 slots `n` numbers take on the wire.
pub fn slots(n: usize, format: Precision) -> usize {
    match format {
        Precision::F32 => n,
        Precision::Bf16 => n.div_ceil(2),
        Precision::Fp8 => n.div_ceil(4),
    }
}

/// The largest |x| of each of `MAXIMA` slices of `t` (f32, on `t`'s device): their max over
/// every shard of a weight, all-reduced, is the weight's amax.
pub fn abs_max(t: &Tensor) -> Tensor {
    if let Some(d) = gpu("abs_max", &[t]) {
        return fatal("abs_max", d.abs_max(t));
    }
    let (v, per) = (t.host(), t.numel().div_ceil(MAXIMA).max(1));
    let max = |c: &[f32]| c.iter().fold(0.0f32, |m, x| if x.is_finite() { m.max(x.abs()) } else { f32::INFINITY });
    let mut partial: Vec<f32> = v.chunks(per).map(max).collect();
    partial.resize(MAXIMA, 0.0);
    Tensor::from_vec(&[MAXIMA], partial)
}

/// `t`'s numbers in `format`, packed into f32 slots (`amax`: for FP8, the weight's
/// `abs_max` maxima over every shard).
pub fn pack(t: &Tensor, format: Precision, amax: Option<&Tensor>) -> Tensor {
    if let Some(d) = gpu("pack", &[t]) {
        return fatal("pack", d.pack(t, format, amax));
    }
    let v = t.host();
    let bits: Vec<u32> = match format {
        Precision::F32 => return Tensor::from_vec(&[v.len()], v.to_vec()),
        Precision::Bf16 => v.chunks(2).map(|p| p.iter().rev().fold(0, |w, &x| (w << 16) | bf16_bits(x))).collect(),
        Precision::Fp8 => {
            let s = scale_for(largest(amax), Fp8::E4M3);
            v.chunks(4).map(|q| q.iter().rev().fold(0, |w, &x| (w << 8) | Fp8::E4M3.encode(x * s) as u32)).collect()
        }
    };
    Tensor::from_vec(&[bits.len()], bits.into_iter().map(f32::from_bits).collect())
}

/// The `n` numbers packed in `format` from slot `at` of `packed`, decoded into the compute
/// dtype of `packed`'s device (`amax` as for `pack`).
pub fn unpack(packed: &Tensor, at: usize, n: usize, format: Precision, amax: Option<&Tensor>) -> Tensor {
    if let Some(d) = gpu("unpack", &[packed]) {
        return fatal("unpack", d.unpack(packed, at, n, format, amax));
    }
    let slots = &packed.host()[at..at + self::slots(n, format)];
    let per_slot = |k: usize, f: &dyn Fn(u32) -> f32| -> Vec<f32> {
        let width = 32 / k;
        let every =
            slots.iter().flat_map(|s| (0..k).map(move |i| (s.to_bits() >> (i * width)) & ((1u64 << width) - 1) as u32));
        every.take(n).map(f).collect()
    };
    let values = match format {
        Precision::F32 => slots.to_vec(),
        Precision::Bf16 => per_slot(2, &|b| half::bf16::from_bits(b as u16).to_f32()),
        Precision::Fp8 => {
            let inverse = 1.0 / scale_for(largest(amax), Fp8::E4M3);
            per_slot(4, &|b| Fp8::E4M3.decode(b as u8) * inverse)
        }
    };
    Tensor::from_vec(&[n], values)
}

/// The largest of the maxima an FP8 weight travels with.
fn largest(amax: Option<&Tensor>) -> f32 {
    amax.expect("an FP8 weight travels with its maxima").host().iter().cloned().fold(0.0, f32::max)
}

/// The bits of `x` rounded to bf16.
fn bf16_bits(x: f32) -> u32 {
    half::bf16::from_f32(x).to_bits() as u32
}
