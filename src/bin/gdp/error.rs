//! The CLI's error: one message, printed as one `error: ...` line, exit code 1.

use std::fmt;

/// An input or runtime error of the CLI (exit code 1). The message names the offending tensor
/// by its name in the input file, or the flag as written on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CliError(String);

impl CliError {
    pub fn new(msg: impl Into<String>) -> Self {
        Self(one_line(&msg.into()))
    }

    /// A library (Candle or candle-gdp) error, its FLA option names mapped to the CLI's names:
    /// `initial_state` is the file's `h0`, `scale` is the `--scale` flag, `cp_size` (the number
    /// of context-parallel ranks) is the `--cp-size` flag.
    pub fn from_lib(e: &candle_core::Error) -> Self {
        let msg = flatten(e)
            .replace("`initial_state`", "`h0`")
            .replace("`scale`", "`--scale`")
            .replace("cp_size", "--cp-size");
        Self::new(msg)
    }

    /// A library error about one tensor: prefixed by its name unless the message names it.
    pub fn tensor(name: &str, e: &candle_core::Error) -> Self {
        let msg = Self::from_lib(e).0;
        if msg.contains(&format!("`{name}`")) {
            Self(msg)
        } else {
            Self::new(format!("`{name}`: {msg}"))
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CliError {}

/// A Candle error without its backtraces, its context chain joined with `: `.
fn flatten(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } => flatten(inner),
        E::Context { inner, context } => format!("{context}: {}", flatten(inner)),
        E::WithPath { inner, path } => format!("{}: {}", path.display(), flatten(inner)),
        E::WrappedContext { wrapped, context } => format!("{context}: {wrapped}"),
        other => other.to_string(),
    }
}

/// Collapses a possibly multi-line message into one line: drops the frames of any backtrace
/// that slipped through, joins the remaining lines with `; ` and squeezes whitespace.
pub fn one_line(msg: &str) -> String {
    let mut parts: Vec<String> = vec![];
    for line in msg.lines() {
        let t = line.trim();
        if t.is_empty() || is_backtrace_line(t) {
            continue;
        }
        let squeezed = t.split_whitespace().collect::<Vec<_>>().join(" ");
        parts.push(squeezed);
    }
    if parts.is_empty() {
        return "unknown error".to_string();
    }
    parts.join("; ")
}

/// `  12: std::rt::lang_start` / `at /rustc/.../main.rs:5:9` / `stack backtrace:` lines.
fn is_backtrace_line(t: &str) -> bool {
    let frame = t
        .split_once(": ")
        .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    frame
        || t.starts_with("at ")
        || t == "stack backtrace:"
        || t.starts_with("note: Some details are omitted")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapses_lines_and_backtraces() {
        let msg = "ctx\n`q`: bad\nstack backtrace:\n   0: foo::bar\n             at src/x.rs:1:2\n";
        assert_eq!(one_line(msg), "ctx; `q`: bad");
        assert_eq!(one_line("  a   b \n\n"), "a b");
        assert_eq!(one_line(""), "unknown error");
    }

    #[test]
    fn maps_fla_names() {
        let e = candle_core::Error::Msg("`initial_state`: expected shape".into()).context("ctx");
        assert_eq!(CliError::from_lib(&e).0, "ctx: `h0`: expected shape");
        let e = candle_core::Error::Msg("rank".into());
        assert_eq!(CliError::tensor("do", &e).0, "`do`: rank");
        let e = candle_core::Error::Msg("`cp_size`: cp_size 9 exceeds".into());
        assert_eq!(CliError::from_lib(&e).0, "`--cp-size`: --cp-size 9 exceeds");
    }
}
