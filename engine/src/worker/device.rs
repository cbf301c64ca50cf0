//! Push and pull of CUDA device memory (feature `cuda`).
//!
//! A [`DeviceRegion`] is device memory paired with a page-locked staging [`Region`]
//! (`falcon_transport::cuda`): these functions move the device's floats through it with one
//! DMA copy each way, shard by shard, so a gradient on the device is pushed without the
//! caller copying it, and a pull lands on the device. Each transport sees only the staging
//! region, as it sees any region.
//!
//! [`Region`]: falcon_transport::Region

use falcon_transport::cuda::DeviceRegion;

use super::{ShardRemote, Worker};
use crate::error::Result;

impl Worker {
    /// Pushes the gradient in device memory `grad` (a region of the tensor's length) for
    /// `clock`, and waits for the servers' acknowledgements, as [`Worker::push`] does.
    ///
    /// Every shard's part is first queued for copying from the device into `grad`'s staging
    /// region (after the work already queued on `grad`'s device memory, from any stream);
    /// shard `i` is written to its server as soon as its copy landed, while the copies of
    /// the shards after it are still running. `grad`'s staging region is overwritten; the
    /// device memory is not.
    pub fn push_device(&self, tensor: &str, grad: &DeviceRegion, clock: u64) -> Result<()> {
        let shards = self.push_shards(tensor, grad.staging(), clock)?;
        let mut staged = Vec::with_capacity(shards.len());
        for s in &shards {
            staged.push(Some(
                grad.stage_out(s.spec.offset as usize, s.spec.len as usize)?,
            ));
        }
        let handle = self.write_pushes(shards, grad.staging(), clock, |i| {
            if let Some(copy) = staged[i].take() {
                copy.wait()?;
            }
            Ok(())
        });
        // An error before every copy was waited for: let them land before anything else
        // touches the staging region.
        let drained = grad.synchronize();
        handle?.wait()?;
        drained?;
        Ok(())
    }

    /// Pulls `tensor` for iteration `clock` into device memory `out` (a region of the
    /// tensor's length): returns, as [`Worker::pull`] does, when `out`'s device memory holds
    /// values the policy allows this clock to see.
    ///
    /// The servers write (or the lock-free path reads) each shard into `out`'s staging
    /// region; each shard's copy to the device is queued as soon as it is there, so it runs
    /// while the next shard is read. Work queued later on `out`'s device memory, from any
    /// stream, comes after the copies.
    pub fn pull_device(&self, tensor: &str, out: &mut DeviceRegion, clock: u64) -> Result<()> {
        let staging = out.staging().clone();
        let pulled = (|| -> Result<()> {
            let mut stage = |s: &ShardRemote| -> Result<()> {
                out.stage_in(s.spec.offset as usize, s.spec.len as usize)?;
                Ok(())
            };
            let slow = self.pull_shards(tensor, &staging, clock, Some(&mut stage))?;
            for (s, sig) in slow {
                sig.wait(None)?;
                out.stage_in(s.spec.offset as usize, s.spec.len as usize)?;
            }
            Ok(())
        })();
        let drained = out.synchronize();
        pulled?;
        drained?;
        Ok(())
    }
}
