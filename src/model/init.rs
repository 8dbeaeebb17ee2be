//! # Deterministic init: one model, whatever the topology
//!
//! Each parameter is drawn from its own random stream, keyed by (seed, parameter name), over its
//! *full* shape in row-major order. A sharded run (tensor or pipeline parallel) draws the full
//! tensor the same way and keeps its slice, so every topology starts from bit-identical weights:
//! torchtitan's "seed checkpoint", without the checkpoint. The same keyed streams give the data
//! its randomness (`data/mod.rs`), so no stream depends on how many were drawn before it.

use crate::ops::tensor::Tensor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A random stream that depends only on `seed` and `key` (FNV-1a of the key, spread to 32 bytes).
pub fn stream(seed: u64, key: &str) -> ChaCha8Rng {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&h.to_le_bytes());
    bytes[16..24].copy_from_slice(&(key.len() as u64).to_le_bytes());
    ChaCha8Rng::from_seed(bytes)
}

/// N(0, std²) over the full `shape`, by Box–Muller on the (seed, name) stream.
pub fn normal(seed: u64, name: &str, shape: &[usize], std: f32) -> Tensor {
    let mut rng = stream(seed, name);
    let n: usize = shape.iter().product();
    let mut data = Vec::with_capacity(n + 1);
    while data.len() < n {
        let u1: f64 = 1.0 - rng.gen::<f64>(); // in (0, 1], so ln is finite
        let u2: f64 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        data.push((r * a.cos()) as f32 * std);
        data.push((r * a.sin()) as f32 * std);
    }
    data.truncate(n);
    Tensor::from_vec(shape, data)
}

pub fn ones(shape: &[usize]) -> Tensor {
    Tensor::from_vec(shape, vec![1.0; shape.iter().product()])
}

/// Moves every value by one unit in the last place of `dtype` (f32, or bf16 for a bf16 compute
/// copy: the value becomes a bf16 one step up or down from its rounding), up or down as the
/// (name, index) stream says: a difference the size of one rounding in that precision.
/// `converge` trains such a copy of its baseline to see how far rounding alone moves the curve.
pub fn nudge(name: &str, values: &[f32], dtype: crate::ops::DType) -> Vec<f32> {
    let mut rng = stream(0, name);
    let step = |up: bool, bits: u32| if up { bits.wrapping_add(1) } else { bits.wrapping_sub(1) };
    values
        .iter()
        .map(|&v| {
            let up = rng.gen::<bool>() || v == 0.0; // below +0 lies -0's neighbour: go up instead
            match dtype {
                crate::ops::DType::F32 => f32::from_bits(step(up, v.to_bits())),
                crate::ops::DType::Bf16 => {
                    let b = half::bf16::from_f32(v).to_bits() as u32;
                    half::bf16::from_bits(step(up, b) as u16).to_f32()
                }
            }
        })
        .collect()
}
