//! How this process was launched, and the collectives that follow from it: MPI under a
//! launcher (with `--features mpi`), else a single process; and how the process ends (an
//! error in a job of several processes must end the job at once). Apart from
//! [`super::comm`], whose trait the MPI implementation uses.

use super::comm::Collectives;
use anyhow::{bail, Result};

/// The number of ranks a launcher (mpirun, srun) says this job has, if it says.
pub fn launched_world_size() -> Option<usize> {
    crate::core::env::launcher_number(&crate::core::env::WORLD_SIZE)
}

/// This process's rank as the launcher says it, if it says.
pub fn launched_rank() -> Option<usize> {
    crate::core::env::launcher_number(&crate::core::env::WORLD_RANK)
}

/// End the process after the command, on the main thread. After success MPI (if any) is
/// finalized. After an error in a job of several processes the error is printed and the
/// process exits at once without finalizing, which makes the launcher end the other ranks (they
/// may be waiting in a collective for this one; finalizing would wait for them in turn).
pub fn finish(result: anyhow::Result<()>) -> ! {
    match result {
        Ok(()) => {
            #[cfg(feature = "mpi")]
            super::mpi::finalize();
            std::process::exit(0)
        }
        Err(e) => match (launched_world_size(), launched_rank()) {
            (Some(n), rank) if n > 1 => {
                use std::io::Write;
                let rank = rank.map_or("?".into(), |r| r.to_string());
                let _ = writeln!(std::io::stderr(), "error (rank {rank} of {n}): {e:#}");
                let _ = std::io::stderr().flush();
                // SAFETY: _exit ends the process without running atexit handlers (MPI's among
                // them, which would wait for the other ranks).
                unsafe { libc::_exit(1) }
            }
            _ => {
                eprintln!("error: {e:#}");
                std::process::exit(1)
            }
        },
    }
}

/// The collectives of this process, chosen once at start-up: MPI when a launcher started it
/// (and llmrs was built with `--features mpi`), else a single process.
pub fn open(timeout: std::time::Duration) -> Result<Box<dyn Collectives>> {
    let launched = launched_world_size();
    #[cfg(feature = "mpi")]
    if launched.is_some() {
        return Ok(Box::new(super::mpi::MpiComm::init(timeout)?));
    }
    let _ = timeout;
    match launched {
        Some(n) if n > 1 => bail!(
            "started by an MPI launcher as one of {n} processes, but this llmrs was built without MPI: rebuild with \
             `cargo build --release --features mpi` (needs Open MPI: apt install libopenmpi-dev openmpi-bin libclang-dev)"
        ),
        _ => Ok(Box::new(super::comm::SingleProcess)),
    }
}
