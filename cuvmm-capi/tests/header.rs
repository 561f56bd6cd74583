//! `include/cuvmm.h` is what cbindgen makes of the declarations in `src/` (`cbindgen.toml`): a
//! signature, a field or a doc comment changed in Rust and not in the header fails here.
//! `tools/gen-header` writes the header anew.

use std::path::Path;

fn generated() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    String::from_utf8(out).expect("the header is UTF-8")
}

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/cuvmm.h");
    let want = generated();
    if let Some(out) = std::env::var_os("CUVMM_WRITE_HEADER") {
        std::fs::write(&out, &want).expect("writing the header");
        return;
    }
    let have = std::fs::read_to_string(&path).expect("include/cuvmm.h");
    if have != want {
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .map_or_else(|| have.lines().count().min(want.lines().count()) + 1, |i| i + 1);
        panic!(
            "include/cuvmm.h differs from what cbindgen generates from line {line} on: run tools/gen-header"
        );
    }
}
