//! # The formats weights travel in when ZeRO gathers them: as their GEMMs read them
//!
//! ZeRO gathers every weight from its partitions (`zero.rs`: after the update at ZeRO-1 and 2,
//! before each unit computes under FSDP), by default as its fp32 master. A GEMM reading bf16
//! needs only bf16 (the GPU's mixed precision), and one reading FP8 only the FP8 bytes and the
//! scale: this is the `Formats` ZeRO's gather plugs in to send each
//! weight as its GEMMs read it (`Param::precision`; the packing itself is `ops/packing.rs`):
//!
//! ```text
//! a weight whose GEMMs read    travels as             slots of a partition of c numbers
//! FP8                          E4M3 bytes, 4 a slot   ⌈c/4⌉   (its amax agreed first)
//! bf16, or any on a bf16 GPU   bf16, 2 a slot         ⌈c/2⌉
//! f32                          the master as it is    c
//! ```
//! FP8 needs one scale for the whole weight, not one per partition: before a gather, the group
//! all-reduces (max) every FP8 weight's per-partition maxima in one call, and each rank casts its
//! partition with the weight's scale.

use crate::comm::{Group, ReduceOp};
use crate::model::{Llama, Param};
use crate::ops::tensor::Tensor;
use crate::ops::{self, packing, DType, Precision};
use crate::parallel::zero::{partition_of, Formats, Master, Packing};
use anyhow::Result;
use std::borrow::Cow;
use std::rc::Rc;

/// Each weight as its GEMMs read it.
pub struct AsGemmsRead;

/// The formats `model`'s weights travel in: its masters as they are (`Master`, ZeRO's own) where
/// every GEMM reads f32, so that nothing of this file runs; else each as its GEMMs read it.
pub fn for_model(model: &Llama) -> Rc<dyn Formats> {
    let f32 = model.place().dtype() == DType::F32 && model.params().iter().all(|p| p.precision == Precision::F32);
    if f32 {
        Rc::new(Master)
    } else {
        Rc::new(AsGemmsRead)
    }
}

/// A sharded parameter's partition of its fp32 master.
fn master(p: &Param) -> &Tensor {
    &partition_of(p).expect("a sharded parameter").master
}

/// A partition in a packed format (`ops/packing.rs`): bf16, or FP8 with the weight's maxima.
struct Packed {
    format: Precision,
    amax: Option<Tensor>,
}

impl Packing for Packed {
    fn pack<'t>(&self, partition: &'t Tensor) -> Cow<'t, Tensor> {
        Cow::Owned(packing::pack(partition, self.format, self.amax.as_ref()))
    }

    fn slots(&self, c: usize) -> usize {
        packing::slots(c, self.format)
    }

    fn unpack<'t>(&self, gathered: &'t Tensor, from: usize, c: usize) -> (Cow<'t, Tensor>, usize) {
        (Cow::Owned(packing::unpack(gathered, from, c, self.format, self.amax.as_ref())), 0)
    }
}

impl Formats for AsGemmsRead {
    /// One all-reduce (max) of the unit's FP8 weights' maxima first, when it has any.
    fn packings(&self, group: &Group, params: &[&Param]) -> Result<Vec<Box<dyn Packing>>> {
        let compute = params.first().map_or(DType::F32, |p| master(p).place().dtype());
        let format = |p: &Param| match (p.precision, compute) {
            (Precision::Fp8, _) => Precision::Fp8,
            (Precision::Bf16, _) | (_, DType::Bf16) => Precision::Bf16,
            _ => Precision::F32,
        };
        let fp8: Vec<&Tensor> = params.iter().filter(|p| format(p) == Precision::Fp8).map(|p| master(p)).collect();
        let mut maxima = match fp8.is_empty() {
            true => Vec::new(),
            false => {
                let mut all = ops::concat(
                    &fp8.iter().map(|m| packing::abs_max(m)).collect::<Vec<_>>().iter().collect::<Vec<_>>(),
                );
                group.all_reduce_tensor(&mut all, ReduceOp::Max)?; // a wait: every partition's maxima
                (0..fp8.len()).map(|i| ops::slice(&all, i * packing::MAXIMA, &[packing::MAXIMA])).collect()
            }
        }
        .into_iter();
        Ok(params
            .iter()
            .map(|p| match format(p) {
                Precision::F32 => Box::new(Master) as Box<dyn Packing>,
                Precision::Fp8 => Box::new(Packed { format: Precision::Fp8, amax: maxima.next() }),
                format => Box::new(Packed { format, amax: None }),
            })
            .collect())
    }
}
