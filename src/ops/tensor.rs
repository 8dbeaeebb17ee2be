//! # Tensors: a shape and its storage on a device
//!
//! A `Tensor` is a row-major array with a shape. Its storage lives on a device: `Storage::Cpu`
//! holds `f32` in host memory; `Storage::Cuda` holds a GPU buffer (`cuda::device::Buf`) in one of three
//! forms: f32, bf16, or — for a *parameter* in mixed precision — an fp32 master copy together
//! with the bf16 copy that the kernels compute with (the optimizer updates the first and rewrites
//! the second). Model code never looks inside the storage: it hands tensors to the op layer
//! (`ops/mod.rs`), which picks the kernels for the device the tensor lives on. Host copies
//! (`to_vec`, `from_vec`, `write`) are how data enters and leaves: batches, checkpoints, tests;
//! the collectives of the local hub read and write through `host_view` and `update_host`, in place
//! on the CPU and through a host copy on a GPU.

use crate::cuda::device::{Buf, Device};
use crate::cuda::runtime::Gpu;
use crate::ops::meter::{self, HostBuf};
use crate::ops::types::DType;
use std::borrow::Cow;
use std::sync::Arc;

/// Where a tensor's numbers live.
#[derive(Clone, Debug)]
pub enum Storage {
    Cpu(HostBuf),
    Cuda(Buf),
}

/// A device tensors can be placed on.
#[derive(Clone)]
pub enum Place {
    Cpu,
    /// A rank's GPU and the dtype it computes in.
    Cuda(Arc<Device>),
}

impl Place {
    /// Where a rank computes: its GPU (computing in `dtype`) when it has one, else the CPU.
    pub fn for_rank(gpu: Option<&Gpu>, dtype: DType) -> anyhow::Result<Place> {
        Ok(match gpu {
            Some(gpu) => Place::Cuda(Device::new(gpu, dtype)?),
            None => Place::Cpu,
        })
    }

    /// The most bytes this rank's tensors here held at once since the last call: the GPU's, or
    /// on the CPU those counted in this thread's meter (0 without one).
    pub fn take_peak_bytes(&self) -> usize {
        match self {
            Place::Cpu => meter::take_peak_bytes(),
            Place::Cuda(dev) => dev.take_peak_bytes(),
        }
    }

    /// The dtype activations are computed in here.
    pub fn dtype(&self) -> DType {
        match self {
            Place::Cpu => DType::F32,
            Place::Cuda(dev) => dev.dtype,
        }
    }

    /// The same device (the CPU, or the same rank's GPU).
    pub fn is(&self, other: &Place) -> bool {
        match (self, other) {
            (Place::Cpu, Place::Cpu) => true,
            (Place::Cuda(a), Place::Cuda(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

impl Tensor {
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor::from_vec(shape, vec![0.0; shape.iter().product()])
    }

    /// A tensor holding `data` (row-major). The length must match the shape.
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Tensor {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "tensor data does not match shape {shape:?}");
        Tensor { shape: shape.to_vec(), storage: Storage::Cpu(HostBuf::new(data)) }
    }

    /// Host data as a tensor on `place` (on a GPU, in its compute dtype).
    pub fn from_host(shape: &[usize], data: Vec<f32>, place: &Place) -> Tensor {
        Tensor::from_host_in(shape, data, place, place.dtype())
    }

    /// Host data as a tensor on `place` in `dtype` (f32 on the CPU).
    pub fn from_host_in(shape: &[usize], data: Vec<f32>, place: &Place, dtype: DType) -> Tensor {
        match place {
            Place::Cpu => Tensor::from_vec(shape, data),
            Place::Cuda(dev) => Tensor::from_buf(shape, dev.upload(&data, dtype)),
        }
    }

    /// A tensor on the GPU; the op layer makes these.
    pub(crate) fn from_buf(shape: &[usize], buf: Buf) -> Tensor {
        Tensor { shape: shape.to_vec(), storage: Storage::Cuda(buf) }
    }

    /// Zeros of `t`'s shape and dtype on `t`'s device (of a mixed-precision weight: a plain bf16
    /// buffer, like its compute copy; gradients and moments are made from the f32 gradient).
    pub fn zeros_like(t: &Tensor) -> Tensor {
        Tensor::zeros_as(&t.shape, t)
    }

    /// Zeros of `shape` on `place`, in `dtype` (f32 on the CPU).
    pub fn zeros_on(shape: &[usize], place: &Place, dtype: DType) -> Tensor {
        match place {
            Place::Cpu => Tensor::zeros(shape),
            Place::Cuda(dev) => Tensor::from_buf(shape, dev.zeros(shape.iter().product(), dtype)),
        }
    }

    /// Zeros of `shape` on `like`'s device, in `like`'s dtype (see `zeros_like`).
    pub fn zeros_as(shape: &[usize], like: &Tensor) -> Tensor {
        Tensor::zeros_on(shape, &like.place(), like.dtype())
    }

    /// A tensor of `shape` on `place`, in `dtype`, whose values are whatever the memory held
    /// (zeros on the CPU): for an output that is then written whole.
    pub fn empty_on(shape: &[usize], place: &Place, dtype: DType) -> Tensor {
        match place {
            Place::Cpu => Tensor::zeros(shape),
            Place::Cuda(dev) => Tensor::from_buf(shape, dev.uninit(shape.iter().product(), dtype)),
        }
    }

    /// `empty_on` `like`'s device, in `like`'s dtype.
    pub fn empty_as(shape: &[usize], like: &Tensor) -> Tensor {
        Tensor::empty_on(shape, &like.place(), like.dtype())
    }

    /// A copy of this tensor on `place`: an activation or statistic keeps its values in the
    /// place's compute dtype (f32 on the CPU); see `to_param` for weights.
    pub fn to(&self, place: &Place) -> Tensor {
        match place {
            Place::Cpu => self.to_dtype(place, DType::F32),
            Place::Cuda(dev) => self.to_dtype(place, dev.dtype),
        }
    }

    /// A copy of this f32 tensor on `place` in the given dtype (gradients and optimizer moments
    /// stay f32 in every mode).
    pub fn to_dtype(&self, place: &Place, dtype: DType) -> Tensor {
        match place {
            Place::Cpu => Tensor::from_vec(&self.shape, self.to_vec()),
            Place::Cuda(dev) => Tensor::from_buf(&self.shape, dev.upload(&self.to_vec(), dtype)),
        }
    }

    /// A weight on `place`: on a GPU in mixed precision, an fp32 master with its bf16 copy.
    pub fn to_param(&self, place: &Place) -> Tensor {
        match place {
            Place::Cpu => Tensor::from_vec(&self.shape, self.to_vec()),
            Place::Cuda(dev) => Tensor::from_buf(&self.shape, dev.upload_param(&self.to_vec())),
        }
    }

    /// The same values seen as `shape` (row-major; the count must match).
    pub fn with_shape(mut self, shape: &[usize]) -> Tensor {
        assert_eq!(shape.iter().product::<usize>(), self.numel(), "with_shape: {:?} into {shape:?}", self.shape);
        self.shape = shape.to_vec();
        self
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows of the tensor seen as a matrix `[numel / last_dim, last_dim]`.
    pub fn rows(&self) -> usize {
        self.numel() / self.cols()
    }

    /// The last dimension.
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }

    /// The bytes the numbers occupy (a mixed-precision weight: its master and its copy).
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::Cpu(v) => 4 * v.len(),
            Storage::Cuda(b) => b.bytes(),
        }
    }

    /// The dtype the kernels read (a mixed-precision weight reads as bf16).
    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::Cpu(_) => DType::F32,
            Storage::Cuda(b) => b.dtype(),
        }
    }

    /// Where the tensor lives.
    pub fn place(&self) -> Place {
        match &self.storage {
            Storage::Cpu(_) => Place::Cpu,
            Storage::Cuda(b) => Place::Cuda(b.device().clone()),
        }
    }

    /// For a mixed-precision weight, a copy of its fp32 master alone on its GPU (what a collective
    /// can move); `None` for any other tensor, which is one array already.
    pub fn master_copy(&self) -> Option<Tensor> {
        match &self.storage {
            Storage::Cuda(b) => b.master_copy().map(|m| Tensor::from_buf(&self.shape, m)),
            Storage::Cpu(_) => None,
        }
    }

    /// A host copy of the data, row-major, as f32 (a mixed-precision weight gives its master).
    pub fn to_vec(&self) -> Vec<f32> {
        match &self.storage {
            Storage::Cpu(v) => v.to_vec(),
            Storage::Cuda(b) => b.to_vec(),
        }
    }

    /// The numbers in host memory, for a collective to send: the CPU data itself, or a copy of a
    /// GPU tensor's (which waits for the GPU).
    pub fn host_view(&self) -> Cow<'_, [f32]> {
        match &self.storage {
            Storage::Cpu(v) => Cow::Borrowed(v),
            Storage::Cuda(b) => Cow::Owned(b.to_vec()),
        }
    }

    /// Runs `f` on the numbers in host memory and keeps what it writes: in place on the CPU; a GPU
    /// tensor goes to the host and back (how the local hub's collectives reach GPU tensors).
    pub fn update_host<R>(&mut self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        match &mut self.written().storage {
            Storage::Cpu(v) => f(v),
            Storage::Cuda(b) => {
                let mut v = b.to_vec();
                let r = f(&mut v);
                b.write(&v);
                r
            }
        }
    }

    /// Overwrites the data with `data` (row-major, f32) wherever the tensor lives.
    pub fn write(&mut self, data: &[f32]) {
        assert_eq!(data.len(), self.numel(), "write: {} values for a tensor of {}", data.len(), self.numel());
        match &mut self.storage {
            Storage::Cpu(v) => v.copy_from_slice(data),
            Storage::Cuda(b) => b.write(data),
        }
    }

    /// This tensor, about to be written in place: on a GPU, what the op layer derived from its
    /// numbers to read them faster (its FP8 copies) is dropped. Every op and collective that
    /// writes an existing tensor takes it as `&mut Tensor` and calls this first.
    pub(crate) fn written(&mut self) -> &mut Tensor {
        if let Storage::Cuda(b) = &mut self.storage {
            b.written();
        }
        self
    }

    /// The GPU buffer, when the tensor is on a GPU; for the op layer.
    pub(crate) fn gpu(&self) -> Option<&Buf> {
        match &self.storage {
            Storage::Cpu(_) => None,
            Storage::Cuda(b) => Some(b),
        }
    }

    /// The CPU data; for the op layer's CPU arm.
    pub(crate) fn host(&self) -> &[f32] {
        match &self.storage {
            Storage::Cpu(v) => v,
            Storage::Cuda(_) => panic!("a GPU tensor was read as a CPU one (use to_vec, or the op layer)"),
        }
    }

    pub(crate) fn host_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Cpu(v) => v,
            Storage::Cuda(_) => panic!("a GPU tensor was written as a CPU one (use write, or the op layer)"),
        }
    }
}
