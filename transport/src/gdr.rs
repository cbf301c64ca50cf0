//! How device memory would meet an RDMA NIC: the registration decision, made as NCCL makes
//! it, as a pure function of what was probed (so it is tested on any machine).
//!
//! Order: a dma-buf (`cuMemGetHandleForAddressRange` exports the device range as a file
//! descriptor, `ibv_reg_dmabuf_mr` registers it: the upstream kernel path), else peer memory
//! (`ibv_reg_mr` on the device pointer itself, which works when the `nvidia_peermem` module
//! is loaded), else page-locked host staging (a [`crate::cuda::DeviceRegion`]: one DMA copy
//! each way, which every medium can move). A path that the probes rule out is skipped with
//! its reason; a registration that fails at run time falls through to the next path
//! ([`GdrPlan::after`]).
//!
//! falcon's rdma medium registers host regions only, so today it always takes the staging
//! path; `falcon doctor` prints the plan a device would get, with the verbs' answer to the
//! dma-buf probe (`rdma_dmabuf_support`, feature `rdma`) in it.

/// What was found on this machine for one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GdrProbe {
    /// Not turned off by the operator (`FALCON_GDR=0`; see [`gdr_enabled`]).
    pub enabled: bool,
    /// The CUDA version the driver supports, (major, minor).
    pub cuda_version: (i32, i32),
    /// The device supports GPUDirect RDMA (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`).
    pub device_gpu_direct_rdma: bool,
    /// The device can export dma-bufs (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub device_dma_buf: bool,
    /// Whether libibverbs and the kernel register dma-bufs: NCCL calls `ibv_reg_dmabuf_mr`
    /// with fd -1 and takes `EOPNOTSUPP` or `EPROTONOSUPPORT` as "no" (any other failure as
    /// "yes"). `None`: not probed (no NIC opened), in which case the path is tried.
    pub verbs_dma_buf: Option<bool>,
    /// The peer-memory module (`nvidia_peermem` or `nv_peer_mem`) is loaded.
    pub peer_memory: bool,
}

/// One way of making device memory reachable by the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdrPath {
    /// `cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer (peer memory).
    PeerMemory,
    /// Page-locked host staging with a DMA copy.
    Staging,
}

impl GdrPath {
    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            GdrPath::DmaBuf => "dma-buf",
            GdrPath::PeerMemory => "peer memory",
            GdrPath::Staging => "page-locked staging",
        }
    }
}

/// The paths to try, in order (the last is always [`GdrPath::Staging`]), and why the others
/// were left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GdrPlan {
    /// The paths to try, best first.
    pub tries: Vec<GdrPath>,
    /// The paths left out, each with the reason.
    pub skipped: Vec<(GdrPath, &'static str)>,
}

impl GdrPlan {
    /// The path to try first.
    pub fn first(&self) -> GdrPath {
        self.tries[0]
    }

    /// The path to try once registering with `failed` failed: the next one of the plan
    /// (staging, which needs no registration of device memory, is the last).
    pub fn after(&self, failed: GdrPath) -> GdrPath {
        self.tries
            .iter()
            .skip_while(|&&p| p != failed)
            .nth(1)
            .copied()
            .unwrap_or(GdrPath::Staging)
    }
}

/// `cuMemGetHandleForAddressRange` with a dma-buf handle needs CUDA 11.7.
const DMA_BUF_CUDA: (i32, i32) = (11, 7);

/// The registration plan for a device with these probe results.
pub fn gdr_plan(p: &GdrProbe) -> GdrPlan {
    let mut tries = Vec::new();
    let mut skipped = Vec::new();
    let gdr = if !p.enabled {
        Err("turned off (FALCON_GDR=0)")
    } else if !p.device_gpu_direct_rdma {
        Err("the device does not support GPUDirect RDMA")
    } else {
        Ok(())
    };
    let dma_buf = gdr.and_then(|()| {
        if p.cuda_version < DMA_BUF_CUDA {
            Err("the driver predates CUDA 11.7 (no dma-buf export)")
        } else if !p.device_dma_buf {
            Err("the device does not export dma-bufs")
        } else if p.verbs_dma_buf == Some(false) {
            Err("libibverbs or the kernel does not register dma-bufs")
        } else {
            Ok(())
        }
    });
    match dma_buf {
        Ok(()) => tries.push(GdrPath::DmaBuf),
        Err(why) => skipped.push((GdrPath::DmaBuf, why)),
    }
    let peer = gdr.and(if p.peer_memory {
        Ok(())
    } else {
        Err("the nvidia_peermem module is not loaded")
    });
    match peer {
        Ok(()) => tries.push(GdrPath::PeerMemory),
        Err(why) => skipped.push((GdrPath::PeerMemory, why)),
    }
    tries.push(GdrPath::Staging);
    GdrPlan { tries, skipped }
}

/// Whether GPUDirect RDMA may be used, from the value of `FALCON_GDR` (unset or empty: yes;
/// `0`, `off`, `no`, `false`: no).
pub fn gdr_enabled(var: Option<&str>) -> bool {
    !matches!(
        var.map(|v| v.trim().to_ascii_lowercase()).as_deref(),
        Some("0" | "off" | "no" | "false")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> GdrProbe {
        GdrProbe {
            enabled: true,
            cuda_version: (13, 0),
            device_gpu_direct_rdma: true,
            device_dma_buf: true,
            verbs_dma_buf: Some(true),
            peer_memory: true,
        }
    }

    #[test]
    fn everything_there_tries_dma_buf_then_peer_memory_then_staging() {
        let plan = gdr_plan(&all());
        assert_eq!(
            plan.tries,
            [GdrPath::DmaBuf, GdrPath::PeerMemory, GdrPath::Staging]
        );
        assert!(plan.skipped.is_empty());
        assert_eq!(plan.first(), GdrPath::DmaBuf);
        assert_eq!(plan.after(GdrPath::DmaBuf), GdrPath::PeerMemory);
        assert_eq!(plan.after(GdrPath::PeerMemory), GdrPath::Staging);
        assert_eq!(plan.after(GdrPath::Staging), GdrPath::Staging);
    }

    #[test]
    fn dma_buf_needs_the_driver_the_device_and_verbs() {
        for (probe, why) in [
            (
                GdrProbe {
                    cuda_version: (11, 6),
                    ..all()
                },
                "11.7",
            ),
            (
                GdrProbe {
                    device_dma_buf: false,
                    ..all()
                },
                "export",
            ),
            (
                GdrProbe {
                    verbs_dma_buf: Some(false),
                    ..all()
                },
                "libibverbs",
            ),
        ] {
            let plan = gdr_plan(&probe);
            assert_eq!(plan.tries, [GdrPath::PeerMemory, GdrPath::Staging]);
            assert_eq!(plan.skipped.len(), 1);
            assert_eq!(plan.skipped[0].0, GdrPath::DmaBuf);
            assert!(plan.skipped[0].1.contains(why), "{}", plan.skipped[0].1);
            // A failed peer-memory registration falls to staging; one that was never planned
            // too.
            assert_eq!(plan.after(GdrPath::PeerMemory), GdrPath::Staging);
            assert_eq!(plan.after(GdrPath::DmaBuf), GdrPath::Staging);
        }
        // Not probed: tried (the registration itself decides).
        let plan = gdr_plan(&GdrProbe {
            verbs_dma_buf: None,
            ..all()
        });
        assert_eq!(plan.first(), GdrPath::DmaBuf);
        assert_eq!(plan.after(GdrPath::DmaBuf), GdrPath::PeerMemory);
    }

    #[test]
    fn without_peer_memory_dma_buf_falls_to_staging() {
        let plan = gdr_plan(&GdrProbe {
            peer_memory: false,
            ..all()
        });
        assert_eq!(plan.tries, [GdrPath::DmaBuf, GdrPath::Staging]);
        assert_eq!(plan.after(GdrPath::DmaBuf), GdrPath::Staging);
        assert!(plan.skipped[0].1.contains("nvidia_peermem"));
    }

    #[test]
    fn no_gpu_direct_or_turned_off_is_staging_only() {
        for (probe, why) in [
            (
                GdrProbe {
                    device_gpu_direct_rdma: false,
                    ..all()
                },
                "does not support GPUDirect",
            ),
            (
                GdrProbe {
                    enabled: false,
                    ..all()
                },
                "FALCON_GDR=0",
            ),
        ] {
            let plan = gdr_plan(&probe);
            assert_eq!(plan.tries, [GdrPath::Staging]);
            assert_eq!(plan.first(), GdrPath::Staging);
            assert_eq!(plan.skipped.len(), 2);
            assert!(plan.skipped.iter().all(|(_, w)| w.contains(why)));
        }
    }

    #[test]
    fn the_switch_reads_like_a_boolean() {
        assert!(gdr_enabled(None));
        assert!(gdr_enabled(Some("")));
        assert!(gdr_enabled(Some("1")));
        for off in ["0", "off", "OFF", " no ", "false"] {
            assert!(!gdr_enabled(Some(off)), "{off}");
        }
    }
}
