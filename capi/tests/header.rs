//! `include/falcon.h` is what cbindgen makes of `src/lib.rs` now: a stale header fails here.
//! `FALCON_BLESS_HEADER=1 cargo test -p falcon-capi --test header` writes it anew.

use std::path::Path;

#[test]
fn the_header_is_up_to_date() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads src/lib.rs");
    let mut made = Vec::new();
    bindings.write(&mut made);
    let made = String::from_utf8(made).expect("the header is UTF-8");
    let path = dir.join("include/falcon.h");
    if std::env::var_os("FALCON_BLESS_HEADER").is_some() {
        std::fs::write(&path, &made).expect("write include/falcon.h");
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == made,
        "capi/include/falcon.h is stale (or missing): regenerate it with\n    \
         FALCON_BLESS_HEADER=1 cargo test -p falcon-capi --test header\nand commit it"
    );
}
