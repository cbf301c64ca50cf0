//! Inputs the fuzz targets (`fuzz/`, run by `tools/fuzz.sh`) found crashing, replayed as
//! plain tests: each must now give a value or a typed error, never a panic.

use std::time::Duration;

use falcon_trainer::hetero::Hetero;

/// fuzz target `specs`, mode 2 (crash-bf50bb24…): `gaussian(13,6…6)` (a standard deviation of
/// 6.7e107 ms) is a valid spec, but its delay overflowed `Duration::from_secs_f64`, which
/// panics. The same overflow was there for a tiny speed ratio and a huge episode slowdown
/// (`Duration::mul_f64`). Delays now saturate at `Duration::MAX`, as a trace's already did.
#[test]
fn huge_but_valid_heterogeneity_saturates_its_delay() {
    let crash = format!("gaussian(13,{})", "6".repeat(108));
    for spec in [
        crash.as_str(),
        "gauss(1e308,0)",
        "h=1e-300",
        "ratio(5e-324)",
        "episodes(1,1,1e300)",
        "episodes(3,2,1.7976931348623157e308)",
    ] {
        let h = Hetero::parse(spec).unwrap_or_else(|e| panic!("{spec} parses: {e}"));
        let mut saturated = false;
        for compute in [
            Duration::from_millis(1),
            Duration::from_secs(1),
            Duration::MAX,
        ] {
            for iter in [0, 1, 2, u64::MAX] {
                saturated |= h.delay(7, iter, compute) == Duration::MAX;
            }
        }
        assert!(saturated, "{spec}: some delay saturates");
    }
    // Ordinary specs keep their exact delays.
    let ms = Duration::from_millis(1);
    assert_eq!(
        Hetero::parse("h=0.25").unwrap().delay(0, 0, 10 * ms),
        30 * ms
    );
    assert_eq!(
        Hetero::parse("episodes(10,3,4)")
            .unwrap()
            .delay(0, 2, 10 * ms),
        30 * ms
    );
    assert_eq!(
        Hetero::parse("episodes(10,3,4)")
            .unwrap()
            .delay(0, 3, 10 * ms),
        Duration::ZERO
    );
    assert_eq!(Hetero::parse("gauss(5,0)").unwrap().delay(9, 9, ms), 5 * ms);
}
