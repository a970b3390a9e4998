//! Python's spellings: `repr` of strings and floats, `OSError` classes for an errno, text decoded
//! as `Path.read_text(encoding, errors)` decodes it, and SWE-ReX's stripping of escape
//! sequences. Messages of the exceptions SWE-ReX's clients re-raise read as Python's would.

use super::SwerexError;

/// Python's `OSError` subclass for an errno, with its message (`[Errno 2] No such file or
/// directory: '/x'`).
pub(super) fn os_error(errno: i32, path: &str) -> SwerexError {
    let class = match errno {
        libc::ENOENT => "FileNotFoundError",
        libc::EACCES | libc::EPERM => "PermissionError",
        libc::EEXIST => "FileExistsError",
        libc::ENOTDIR => "NotADirectoryError",
        libc::EISDIR => "IsADirectoryError",
        _ => "OSError",
    };
    let text = nix::errno::Errno::from_raw(errno).desc();
    SwerexError::exception(
        &format!("builtins.{class}"),
        format!("[Errno {errno}] {text}: {}", py_repr(path)),
    )
}

// Text as Python's `Path.read_text(encoding, errors)` gives it.

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Encoding {
    Utf8,
    Latin1,
    Ascii,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Errors {
    Strict,
    Replace,
    Ignore,
    BackslashReplace,
}

pub(super) struct Codec {
    encoding: Encoding,
    errors: Errors,
    name: &'static str,
}

impl Codec {
    pub(super) fn new(encoding: Option<&str>, errors: Option<&str>) -> Result<Codec, SwerexError> {
        let wanted = encoding.unwrap_or("utf-8").to_ascii_lowercase().replace('_', "-");
        let (encoding, name) = match wanted.as_str() {
            "utf-8" | "utf8" | "u8" | "locale" => (Encoding::Utf8, "utf-8"),
            "latin-1" | "latin1" | "iso-8859-1" | "iso8859-1" | "l1" => (Encoding::Latin1, "latin-1"),
            "ascii" | "us-ascii" => (Encoding::Ascii, "ascii"),
            _ => {
                return Err(SwerexError::exception(
                    "builtins.LookupError",
                    format!(
                        "unsupported encoding: {} (runner reads utf-8, latin-1 and ascii)",
                        encoding.unwrap_or("")
                    ),
                ));
            }
        };
        let errors = match errors.unwrap_or("strict") {
            "strict" => Errors::Strict,
            "replace" => Errors::Replace,
            "ignore" => Errors::Ignore,
            "backslashreplace" => Errors::BackslashReplace,
            other => {
                return Err(SwerexError::exception(
                    "builtins.LookupError",
                    format!("unsupported error handler name {}", py_repr(other)),
                ));
            }
        };
        Ok(Codec { encoding, errors, name })
    }

    pub(super) fn decode(&self, bytes: &[u8]) -> Result<String, SwerexError> {
        let mut out = String::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let (text, bad) = match self.encoding {
                Encoding::Latin1 => {
                    out.extend(bytes[i..].iter().map(|&b| char::from(b)));
                    break;
                }
                Encoding::Ascii => {
                    let n = bytes[i..].iter().position(|b| !b.is_ascii()).unwrap_or(bytes.len() - i);
                    (&bytes[i..i + n], (n < bytes.len() - i).then_some(1))
                }
                Encoding::Utf8 => match std::str::from_utf8(&bytes[i..]) {
                    Ok(_) => (&bytes[i..], None),
                    Err(e) => (
                        &bytes[i..i + e.valid_up_to()],
                        Some(e.error_len().unwrap_or(bytes.len() - i - e.valid_up_to())),
                    ),
                },
            };
            out.push_str(std::str::from_utf8(text).expect("checked above"));
            i += text.len();
            let Some(len) = bad else { break };
            match self.errors {
                Errors::Strict => {
                    let reason = match self.encoding {
                        Encoding::Ascii => "ordinal not in range(128)",
                        _ if i + len == bytes.len() && utf8_start(bytes[i]) => "unexpected end of data",
                        _ if utf8_start(bytes[i]) => "invalid continuation byte",
                        _ => "invalid start byte",
                    };
                    let at = if len == 1 {
                        format!("byte 0x{:02x} in position {i}", bytes[i])
                    } else {
                        format!("bytes in position {i}-{}", i + len - 1)
                    };
                    return Err(SwerexError::exception(
                        "builtins.UnicodeDecodeError",
                        format!("'{}' codec can't decode {at}: {reason}", self.name),
                    ));
                }
                Errors::Replace => out.push('\u{fffd}'),
                Errors::Ignore => {}
                Errors::BackslashReplace => {
                    for b in &bytes[i..i + len] {
                        out.push_str(&format!("\\x{b:02x}"));
                    }
                }
            }
            i += len;
        }
        Ok(out)
    }
}

/// Whether a byte may start a multi-byte UTF-8 sequence.
pub(super) fn utf8_start(b: u8) -> bool {
    (0xc2..=0xf4).contains(&b)
}

/// Text mode's newline translation: `\r\n` and `\r` read as `\n`.
pub(super) fn universal_newlines(text: String) -> String {
    if !text.contains('\r') {
        return text;
    }
    text.replace("\r\n", "\n").replace('\r', "\n")
}

// ---------------------------------------------------------------------------------------------
// Python's spelling of values in messages.

/// `repr(str)`.
pub(super) fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_printable(c) => out.push(c),
            c if (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push(quote);
    out
}

/// `str.isprintable()` for one character (control, format, separator and private-use
/// characters are not), near enough for messages.
pub(super) fn py_printable(c: char) -> bool {
    let n = c as u32;
    !(n < 0x20
        || (0x7f..=0xa0).contains(&n)
        || n == 0xad
        || n == 0x1680
        || (0x2000..=0x200f).contains(&n)
        || (0x2028..=0x202f).contains(&n)
        || (0x205f..=0x206f).contains(&n)
        || n == 0x3000
        || (0xe000..=0xf8ff).contains(&n)
        || n == 0xfeff
        || (0xfff9..=0xfffb).contains(&n)
        || n >= 0xf0000)
}

/// `repr(float)`.
pub(super) fn py_float(f: f64) -> String {
    if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf".into() } else { "-inf".into() }
    } else if f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f:?}")
    }
}

/// A shell word that is exactly `s`.
pub(super) fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// SWE-ReX's `_strip_control_chars` less its `\r\n` → `\n` (a terminal's doing, which our
/// output never had): ANSI escape sequences removed.
pub(super) fn strip_ansi(s: &str) -> String {
    if !s.contains('\x1b') {
        return s.to_string();
    }
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '\x1b' && i + 1 < chars.len() && ('@'..='_').contains(&chars[i + 1]) {
            let mut j = i + 2;
            while j < chars.len() && ('0'..='?').contains(&chars[j]) {
                j += 1;
            }
            while j < chars.len() && (' '..='/').contains(&chars[j]) {
                j += 1;
            }
            if j < chars.len() && ('@'..='~').contains(&chars[j]) {
                i = j + 1;
                continue;
            }
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_reprs() {
        assert_eq!(py_repr("echo hi"), "'echo hi'");
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("a'b\"c"), "'a\\'b\"c'");
        assert_eq!(py_repr("a\nb\t\\\x01"), "'a\\nb\\t\\\\\\x01'");
        assert_eq!(py_repr("é\u{a0}"), "'é\\xa0'");
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.5), "0.5");
        assert_eq!(py_float(0.1), "0.1");
    }

    #[test]
    fn os_errors_read_as_python_s() {
        let SwerexError::Exception {
            class_path, message, ..
        } = os_error(libc::ENOENT, "/x")
        else {
            panic!("not an exception");
        };
        assert_eq!(class_path, "builtins.FileNotFoundError");
        assert_eq!(message, "[Errno 2] No such file or directory: '/x'");
    }

    #[test]
    fn ansi_sequences_go() {
        assert_eq!(strip_ansi("\x1b[31mred\x1b[0m\n"), "red\n");
        assert_eq!(strip_ansi("a\x1b"), "a\x1b");
    }

    #[test]
    fn text_decodes_as_python_does() {
        let utf8 = Codec::new(None, None).unwrap();
        assert_eq!(utf8.decode("é".as_bytes()).unwrap(), "é");
        assert!(matches!(
            utf8.decode(b"a\xffb"),
            Err(SwerexError::Exception { ref class_path, .. }) if class_path == "builtins.UnicodeDecodeError"
        ));
        let lenient = Codec::new(Some("utf-8"), Some("backslashreplace")).unwrap();
        assert_eq!(lenient.decode(b"a\xffb").unwrap(), "a\\xffb");
        let latin = Codec::new(Some("latin-1"), None).unwrap();
        assert_eq!(latin.decode(b"\xe9").unwrap(), "é");
        assert_eq!(universal_newlines("a\r\nb\rc".into()), "a\nb\nc");
    }
}
