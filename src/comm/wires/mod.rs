//! # Wires: one run over several processes
//!
//! Up to here every rank was a thread of one process, meeting the others in its hub
//! (`comm/local.rs`). A launcher (torchrun, mpirun, srun) starts the program many times; these
//! files make those copies one run. Read in this order: `processes` (which ranks this process
//! runs, from the launcher's environment) → `remote` (the hubs of the processes joined: a
//! collective that spans processes becomes messages between hubs) → `note` (what travels on
//! the wire, kind by kind) → `tcp` and `mpi` (the two wires that carry them). GPU tensors cross
//! processes through NCCL instead (`comm/nccl.rs`).

#[cfg(feature = "mpi")]
pub mod mpi;
mod note;
pub mod processes;
pub mod remote;
pub mod tcp;
