//! # Tensors: a shape and its storage on a device
//!
//! A `Tensor` is a row-major array of `f32` with a shape. Its storage lives on a device; today the
//! only device is the CPU (`Storage::Cpu`), and the CUDA backend adds a variant next to it. Model
//! code never looks inside the storage: it hands tensors to the op layer (`ops.rs`), which picks
//! the kernels for the device the tensor lives on. Host copies (`to_vec`, `from_vec`) are how data
//! enters and leaves: batches, checkpoints, tests.

/// Where a tensor's numbers live.
#[derive(Clone, Debug)]
pub enum Storage {
    Cpu(Vec<f32>),
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
        Tensor { shape: shape.to_vec(), storage: Storage::Cpu(data) }
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

    /// A host copy of the data, row-major.
    pub fn to_vec(&self) -> Vec<f32> {
        self.host().to_vec()
    }

    /// The CPU data; for the op layer and host-side code such as checkpoints.
    pub(crate) fn host(&self) -> &[f32] {
        let Storage::Cpu(v) = &self.storage;
        v
    }

    pub(crate) fn host_mut(&mut self) -> &mut [f32] {
        let Storage::Cpu(v) = &mut self.storage;
        v
    }
}
