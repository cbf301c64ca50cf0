//! The precision of gradients and pulled values on the wire: `f32` (exact), or 16 bits per
//! value (`bf16` or `f16`), half the bytes. The servers keep `f32` master weights and apply
//! in `f32`; only what travels is rounded (to nearest, ties to even).
//!
//! - `bf16` keeps `f32`'s range (8 exponent bits) with 8 significant bits: a relative error
//!   of at most 2⁻⁸ per value (half a unit in the last place). The safe choice for gradients.
//! - `f16` has 11 significant bits (relative error at most 2⁻¹¹ in its normal range) but
//!   tops out at 65504: larger magnitudes are saturated to ±65504 rather than sent as
//!   infinities, and magnitudes under 6.1e-5 lose precision (under 6e-8 they become zero).
//!
//! NaN stays NaN in both. Initial values (`Worker::init`) always travel as `f32`.
//!
//! A tensor may carry its own precision ([`crate::TensorSpec::wire`]): the values of a
//! bfloat16 or float16 parameter are exact in 16 bits, so its gradients and values travel as
//! 16 bits without rounding anything the worker had; the step's mean is rounded once, to the
//! tensor's own type. A float16 tensor's own precision is [`Wire::F16Native`], IEEE half
//! precision with its infinities kept (an overflowed gradient stays infinite, as in PyTorch),
//! where the job-wide `f16` saturates.

use half::f16;
use half::slice::HalfFloatSliceExt;
use serde::{Deserialize, Serialize};

/// How values travel between workers and servers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Wire {
    /// 32-bit floats, exact.
    #[default]
    F32,
    /// bfloat16: `f32`'s range, 8 significant bits.
    Bf16,
    /// IEEE half precision: 11 significant bits, saturated at ±65504.
    F16,
    /// IEEE half precision with infinities kept: a float16 tensor's own precision (never a
    /// job's setting).
    F16Native,
}

impl Wire {
    /// Bytes per value on the wire.
    pub fn bytes_per_value(self) -> u64 {
        match self {
            Wire::F32 => 4,
            Wire::Bf16 | Wire::F16 | Wire::F16Native => 2,
        }
    }

    /// Bytes of `len` values on the wire.
    pub fn bytes(self, len: u64) -> u64 {
        len * self.bytes_per_value()
    }

    /// Its name as the settings spell it.
    pub fn name(self) -> &'static str {
        match self {
            Wire::F32 => "f32",
            Wire::Bf16 => "bf16",
            Wire::F16 => "f16",
            Wire::F16Native => "float16",
        }
    }

    /// Encodes `values` into `out` (`self.bytes(values.len())` bytes, little-endian).
    pub fn encode(self, values: &[f32], out: &mut [u8]) {
        debug_assert_eq!(out.len() as u64, self.bytes(values.len() as u64));
        match self {
            Wire::F32 => {
                for (o, v) in out.chunks_exact_mut(4).zip(values) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            Wire::Bf16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(values) {
                    o.copy_from_slice(&bf16_bits(*v).to_le_bytes());
                }
            }
            Wire::F16 | Wire::F16Native => {
                let saturate = self == Wire::F16;
                let (mut clamped, mut half) = ([0f32; CHUNK], [f16::ZERO; CHUNK]);
                for (o, v) in out.chunks_mut(2 * CHUNK).zip(values.chunks(CHUNK)) {
                    let n = v.len();
                    for (c, x) in clamped.iter_mut().zip(v) {
                        *c = if saturate {
                            x.clamp(-F16_MAX, F16_MAX)
                        } else {
                            *x
                        };
                    }
                    half[..n].convert_from_f32_slice(&clamped[..n]);
                    for (o, h) in o.chunks_exact_mut(2).zip(&half[..n]) {
                        o.copy_from_slice(&h.to_bits().to_le_bytes());
                    }
                }
            }
        }
    }

    /// Decodes `bytes` (as [`Wire::encode`] wrote them) into `out`.
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        debug_assert_eq!(bytes.len() as u64, self.bytes(out.len() as u64));
        match self {
            Wire::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Wire::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
            Wire::F16 | Wire::F16Native => {
                let mut half = [f16::ZERO; CHUNK];
                for (o, b) in out.chunks_mut(CHUNK).zip(bytes.chunks(2 * CHUNK)) {
                    let n = o.len();
                    for (h, b) in half.iter_mut().zip(b.chunks_exact(2)) {
                        *h = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                    }
                    half[..n].convert_to_f32_slice(o);
                }
            }
        }
    }

    /// `values` encoded.
    pub fn encoded(self, values: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; self.bytes(values.len() as u64) as usize];
        self.encode(values, &mut out);
        out
    }

    /// `bytes` decoded.
    pub fn decoded(self, bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; bytes.len() / self.bytes_per_value() as usize];
        self.decode(bytes, &mut out);
        out
    }
}

/// Encodes `len` f32 values of `src` at byte `src_off` into `dst` at byte 0, a chunk at a
/// time (no buffer the size of the values).
pub fn encode_region(
    wire: Wire,
    src: &falcon_transport::Region,
    src_off: u64,
    len: u64,
    dst: &falcon_transport::Region,
) -> falcon_transport::Result<()> {
    let (mut raw, mut enc) = (vec![0u8; 4 * CHUNK], vec![0u8; 2 * CHUNK]);
    let per = wire.bytes_per_value();
    let mut vals = vec![0f32; CHUNK];
    let mut i = 0;
    while i < len {
        let n = (len - i).min(CHUNK as u64) as usize;
        src.read_at(src_off + 4 * i, &mut raw[..4 * n])?;
        for (v, b) in vals.iter_mut().zip(raw.chunks_exact(4)).take(n) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        let m = n * per as usize;
        if enc.len() < m {
            enc.resize(m, 0);
        }
        wire.encode(&vals[..n], &mut enc[..m]);
        dst.write_at(per * i, &enc[..m])?;
        i += n as u64;
    }
    Ok(())
}

/// Decodes `len` values that lie encoded at byte `off` of `region` into f32 values in
/// place, from byte `off` on (the encoded bytes are the first part of the f32 range).
/// Works from the last chunk back, so no chunk overwrites encoded bytes not yet read.
pub fn widen_in_place(
    wire: Wire,
    region: &falcon_transport::Region,
    off: u64,
    len: u64,
) -> falcon_transport::Result<()> {
    let per = wire.bytes_per_value();
    if per == 4 || len == 0 {
        return Ok(());
    }
    let (mut raw, mut vals) = (vec![0u8; 2 * CHUNK], vec![0f32; CHUNK]);
    let mut bytes = vec![0u8; 4 * CHUNK];
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(CHUNK as u64);
        let n = (end - start) as usize;
        region.read_at(off + per * start, &mut raw[..n * per as usize])?;
        wire.decode(&raw[..n * per as usize], &mut vals[..n]);
        for (b, v) in bytes.chunks_exact_mut(4).zip(&vals[..n]) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        region.write_at(off + 4 * start, &bytes[..4 * n])?;
        end = start;
    }
    Ok(())
}

/// `x` as bfloat16 bits, rounded to nearest, ties to even; a NaN stays a (quiet) NaN.
/// Branch-free, so the loops over it vectorize.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    (if nan { (b >> 16) | 0x0040 } else { rounded }) as u16
}

/// Values converted at a time through stack buffers (no allocation per call).
const CHUNK: usize = 2048;

/// The largest finite `f16`.
const F16_MAX: f32 = 65504.0;

impl std::str::FromStr for Wire {
    type Err = &'static str;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(Wire::F32),
            "bf16" | "bfloat16" => Ok(Wire::Bf16),
            "f16" | "fp16" | "float16" | "half" => Ok(Wire::F16),
            _ => Err("not a wire precision: f32, bf16 or f16"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(w: Wire, v: &[f32]) -> Vec<f32> {
        w.decoded(&w.encoded(v))
    }

    #[test]
    fn f32_is_exact_and_16_bit_halves_the_bytes() {
        let mut rng = fastrand::Rng::with_seed(1);
        let v: Vec<f32> = (0..1000).map(|_| (rng.f32() - 0.5) * 1e6).collect();
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&round_trip(Wire::F32, &v)), bits(&v));
        assert_eq!(Wire::F32.encoded(&v).len(), 4000);
        assert_eq!(Wire::Bf16.encoded(&v).len(), 2000);
        assert_eq!(Wire::F16.encoded(&v).len(), 2000);
    }

    #[test]
    fn a_16_bit_tensors_own_values_travel_exactly_infinities_and_all() {
        // Every bfloat16 and every float16 bit pattern, widened to f32 as the worker holds
        // them, comes back bit for bit (NaNs as NaNs).
        for bits in 0..=u16::MAX {
            let b = f32::from_bits(u32::from(bits) << 16);
            let h = f16::from_bits(bits).to_f32();
            for (w, x) in [(Wire::Bf16, b), (Wire::F16Native, h)] {
                let y = round_trip(w, &[x])[0];
                assert!(
                    y.to_bits() == x.to_bits() || (x.is_nan() && y.is_nan()),
                    "{} {x:e} → {y:e}",
                    w.name()
                );
            }
        }
        // The job-wide f16 saturates; a float16 tensor's own keeps the infinity.
        assert_eq!(round_trip(Wire::F16, &[f32::INFINITY])[0], 65504.0);
        assert_eq!(
            round_trip(Wire::F16Native, &[f32::INFINITY])[0],
            f32::INFINITY
        );
        assert_eq!(round_trip(Wire::F16Native, &[-1e6])[0], f32::NEG_INFINITY);
        assert!("float16".parse::<Wire>().is_ok_and(|w| w == Wire::F16));
    }

    #[test]
    fn rounding_error_is_within_half_a_unit_in_the_last_place() {
        let mut rng = fastrand::Rng::with_seed(2);
        for _ in 0..100_000 {
            // bf16: any normal magnitude; f16: its normal range.
            let x = (rng.f32() - 0.5) * 10f32.powi(rng.i32(-30..30));
            let y = round_trip(Wire::Bf16, &[x])[0];
            assert!(
                (y - x).abs() <= x.abs() * 2f32.powi(-8),
                "bf16 {x:e} → {y:e}"
            );
            let x16 = (rng.f32() - 0.5) * 10f32.powi(rng.i32(-4..4));
            if x16.abs() >= 6.104e-5 {
                let y16 = round_trip(Wire::F16, &[x16])[0];
                assert!(
                    (y16 - x16).abs() <= x16.abs() * 2f32.powi(-11),
                    "f16 {x16:e} → {y16:e}"
                );
            }
        }
    }

    #[test]
    fn f16_saturates_and_nan_survives() {
        let y = round_trip(Wire::F16, &[1e6, -1e9, f32::INFINITY, f32::NAN, 3.0]);
        assert_eq!(&y[..3], &[65504.0, -65504.0, 65504.0]);
        assert!(y[3].is_nan());
        assert_eq!(y[4], 3.0);
        let b = round_trip(Wire::Bf16, &[f32::NAN, f32::INFINITY, 1e38]);
        assert!(b[0].is_nan() && b[1] == f32::INFINITY && (b[2] - 1e38).abs() < 1e36);
    }

    #[test]
    fn bf16_rounding_is_the_reference_conversion() {
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..200_000 {
            let x = f32::from_bits(rng.u32(..));
            let ours = bf16_bits(x);
            let reference = half::bf16::from_f32(x);
            if x.is_nan() {
                assert!(half::bf16::from_bits(ours).is_nan());
            } else {
                assert_eq!(ours, reference.to_bits(), "{x:e}");
            }
        }
    }

    #[test]
    fn region_helpers_round_trip_across_chunks() {
        let len = 3 * CHUNK as u64 + 17;
        let v: Vec<f32> = (0..len).map(|i| (i as f32 * 0.731).sin() * 3.0).collect();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        for wire in [Wire::Bf16, Wire::F16] {
            let src = falcon_transport::Region::new(8 + 4 * len).unwrap();
            src.write_at(8, &bytes).unwrap();
            let enc = falcon_transport::Region::new(wire.bytes(len)).unwrap();
            encode_region(wire, &src, 8, len, &enc).unwrap();
            let mut e = vec![0u8; wire.bytes(len) as usize];
            enc.read_at(0, &mut e).unwrap();
            assert_eq!(e, wire.encoded(&v), "{wire:?}: chunked encoding");
            // The encoded bytes at the start of an f32 range, widened where they lie.
            let out = falcon_transport::Region::new(12 + 4 * len).unwrap();
            out.write_at(12, &e).unwrap();
            widen_in_place(wire, &out, 12, len).unwrap();
            let mut got = vec![0u8; 4 * len as usize];
            out.read_at(12, &mut got).unwrap();
            let want: Vec<u8> = wire
                .decoded(&e)
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            assert_eq!(got, want, "{wire:?}: widened in place");
        }
    }

    #[test]
    fn names_parse_and_refuse() {
        assert_eq!(" BF16 ".parse::<Wire>(), Ok(Wire::Bf16));
        assert_eq!("fp16".parse::<Wire>(), Ok(Wire::F16));
        assert_eq!("f32".parse::<Wire>(), Ok(Wire::F32));
        assert_eq!(
            "int8".parse::<Wire>(),
            Err("not a wire precision: f32, bf16 or f16")
        );
    }
}
