//! The engine benchmark (summary runner, no criterion groups: each point is a whole cluster).
//! `--test` or `FALCON_BENCH_QUICK=1`: a few iterations, so it cannot rot.

fn main() {
    let quick =
        std::env::args().any(|a| a == "--test") || std::env::var_os("FALCON_BENCH_QUICK").is_some();
    let rows = falcon_bench::engine::summary(quick).expect("engine benchmark");
    let table = falcon_bench::engine::markdown(&rows);
    println!(
        "\nfalcon engine summary ({}):\n\n{table}",
        if quick { "quick" } else { "full" }
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/falcon-bench");
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join("engine.md"), &table);
        let _ = std::fs::write(
            dir.join("engine.json"),
            serde_json::to_string_pretty(&rows).unwrap_or_default(),
        );
    }
}
