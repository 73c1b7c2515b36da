//! Command-line parsing shared by the benchmark examples of difftx-kernels and difftx-core
//! (included with `#[path]`): a bad argument is an error that names it, says why, and shows the
//! example's usage, not a panic.
// Each example uses only part of it.
#![allow(dead_code)]

use candle_core::{Error, Result};

/// `text` parsed as a `T`, or an error naming `what`, saying why, and showing `usage`.
pub fn parse<T: std::str::FromStr>(text: &str, what: &str, usage: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    text.parse().map_err(|e| Error::Msg(format!("{what}: cannot read {text:?} ({e})\nusage: {usage}")))
}

/// `text` split at `:` into exactly `count` numbers (`format` names them, as `TOKENS:IN:OUT`).
pub fn numbers(text: &str, count: usize, format: &str, usage: &str) -> Result<Vec<usize>> {
    let parts: Vec<&str> = text.split(':').collect();
    if parts.len() != count {
        return Err(Error::Msg(format!("expected {format}, got {text:?}\nusage: {usage}")));
    }
    parts.iter().map(|p| parse(p, format, usage)).collect()
}
