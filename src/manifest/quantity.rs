//! Kubernetes resource quantities (`512Mi`, `2Gi`, `500m`, `"2"`, `0.5`), parsed into
//! checked domain values. Pure: no I/O.

use std::fmt;

/// Memory in bytes, as written in a manifest (`512Mi`, `2Gi`, `1e9`, `1073741824`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct MemoryBytes(pub u64);

/// Disk space in bytes (`resources.ephemeralStorage`), written as memory is (`10Gi`, `500M`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct StorageBytes(pub u64);

/// CPU in thousandths of a core (`500m` = 500, `"2"` = 2000, `0.5` = 500).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct MilliCpu(pub u32);

/// Why a quantity was refused; the caller adds the field path and location.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("{0:?} is not a quantity (expected a number with an optional suffix such as 512Mi, 2Gi, 500m)")]
    Syntax(String),
    #[error("{0:?} has an unknown suffix {1:?} (known: Ki Mi Gi Ti Pi Ei k M G T P E m)")]
    Suffix(String, String),
    #[error("{0:?} is out of range")]
    Range(String),
}

/// Smallest memory limit we accept: below a few MiB runc cannot even start the init process.
pub const MIN_MEMORY_BYTES: u64 = 6 * 1024 * 1024;
/// Smallest ephemeral-storage limit we accept: a container's own files (the agent's requests,
/// a shell's state) take a little room.
pub const MIN_STORAGE_BYTES: u64 = 1 << 20;
/// Smallest CPU share: 10m is a 1 ms quota per 100 ms period, the kernel's floor.
pub const MIN_MILLI_CPU: u32 = 10;
/// Largest CPU request we take seriously (1024 cores).
pub const MAX_MILLI_CPU: u32 = 1024 * 1000;

/// A quantity split into an exact decimal mantissa and a multiplier, so `1.5Gi` is exact.
struct Parsed {
    /// Digits of the number without the decimal point.
    digits: u128,
    /// How many of `digits` are after the decimal point.
    scale: u32,
    /// Multiplier of the suffix as a fraction `num / den`.
    num: u128,
    den: u128,
}

fn parse(text: &str) -> Result<Parsed, QuantityError> {
    let t = text.trim();
    let syntax = || QuantityError::Syntax(text.to_string());
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    let number = number.strip_prefix('+').unwrap_or(number);
    if number.is_empty() || number.starts_with('.') && number.len() == 1 {
        return Err(syntax());
    }
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if frac_part.contains('.') || (int_part.is_empty() && frac_part.is_empty()) {
        return Err(syntax());
    }
    if frac_part.len() > 9 || int_part.len() > 20 {
        return Err(QuantityError::Range(text.to_string()));
    }
    let mut digits: u128 = 0;
    for c in int_part.chars().chain(frac_part.chars()) {
        let d = c.to_digit(10).ok_or_else(syntax)?;
        digits = digits * 10 + u128::from(d);
    }
    let scale = frac_part.len() as u32;
    let (num, den): (u128, u128) = match suffix {
        "" => (1, 1),
        "m" => (1, 1000),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        s if s.starts_with(['e', 'E']) => {
            let exp: u32 = s[1..].parse().map_err(|_| syntax())?;
            if exp > 18 {
                return Err(QuantityError::Range(text.to_string()));
            }
            (10u128.pow(exp), 1)
        }
        other => return Err(QuantityError::Suffix(text.to_string(), other.to_string())),
    };
    Ok(Parsed {
        digits,
        scale,
        num,
        den,
    })
}

/// `value * 10^-scale * num / den * unit`, rounded up (Kubernetes rounds limits up).
fn scaled(p: &Parsed, unit: u128) -> Option<u128> {
    let numerator = p.digits.checked_mul(p.num)?.checked_mul(unit)?;
    let denominator = 10u128.checked_pow(p.scale)?.checked_mul(p.den)?;
    Some(numerator.div_ceil(denominator))
}

impl MemoryBytes {
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        let p = parse(text)?;
        if p.den != 1 {
            // `m` on memory means milli-bytes: always a typo for `M` or `Mi`.
            return Err(QuantityError::Suffix(text.to_string(), "m".to_string()));
        }
        let bytes = scaled(&p, 1).ok_or_else(|| QuantityError::Range(text.to_string()))?;
        let bytes = u64::try_from(bytes).map_err(|_| QuantityError::Range(text.to_string()))?;
        // runc writes the limit as a signed 64-bit number.
        if bytes > i64::MAX as u64 {
            return Err(QuantityError::Range(text.to_string()));
        }
        Ok(MemoryBytes(bytes))
    }
}

impl StorageBytes {
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        MemoryBytes::parse(text).map(|m| StorageBytes(m.0))
    }
}

impl fmt::Display for StorageBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        MemoryBytes(self.0).fmt(f)
    }
}

impl MilliCpu {
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        let p = parse(text)?;
        let milli = scaled(&p, 1000).ok_or_else(|| QuantityError::Range(text.to_string()))?;
        let milli = u32::try_from(milli).map_err(|_| QuantityError::Range(text.to_string()))?;
        Ok(MilliCpu(milli))
    }
}

impl fmt::Display for MemoryBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)];
        for (suffix, unit) in UNITS {
            if self.0 >= unit && self.0.is_multiple_of(unit) {
                return write!(f, "{}{suffix}", self.0 / unit);
            }
        }
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for MilliCpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_multiple_of(1000) {
            write!(f, "{}", self.0 / 1000)
        } else {
            write!(f, "{}m", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_quantities_follow_kubernetes_suffixes() {
        let cases = [
            ("512Mi", 512 << 20),
            ("2Gi", 2 << 30),
            ("1.5Gi", 3 << 29),
            ("1G", 1_000_000_000),
            ("128974848", 128_974_848),
            ("129e6", 129_000_000),
            ("100k", 100_000),
            ("64Ki", 65_536),
        ];
        for (text, bytes) in cases {
            assert_eq!(MemoryBytes::parse(text), Ok(MemoryBytes(bytes)), "{text}");
        }
    }

    #[test]
    fn memory_rejects_words_milli_and_overflow() {
        assert!(matches!(MemoryBytes::parse("lots"), Err(QuantityError::Syntax(_))));
        assert!(matches!(MemoryBytes::parse("512m"), Err(QuantityError::Suffix(..))));
        assert!(matches!(MemoryBytes::parse("5Zi"), Err(QuantityError::Suffix(..))));
        assert!(matches!(MemoryBytes::parse("99999Ei"), Err(QuantityError::Range(_))));
        assert!(matches!(MemoryBytes::parse(""), Err(QuantityError::Syntax(_))));
        assert!(matches!(MemoryBytes::parse("-1Gi"), Err(QuantityError::Syntax(_))));
        assert!(matches!(MemoryBytes::parse("1.2.3"), Err(QuantityError::Syntax(_))));
    }

    #[test]
    fn cpu_quantities_are_millicores() {
        assert_eq!(MilliCpu::parse("500m"), Ok(MilliCpu(500)));
        assert_eq!(MilliCpu::parse("2"), Ok(MilliCpu(2000)));
        assert_eq!(MilliCpu::parse("0.5"), Ok(MilliCpu(500)));
        assert_eq!(MilliCpu::parse("1.25"), Ok(MilliCpu(1250)));
        assert_eq!(MilliCpu::parse("0.0001"), Ok(MilliCpu(1)));
        assert!(MilliCpu::parse("two").is_err());
    }

    #[test]
    fn quantities_display_in_their_shortest_exact_form() {
        assert_eq!(MemoryBytes(2 << 30).to_string(), "2Gi");
        assert_eq!(MemoryBytes(1_000_000_000).to_string(), "1000000000");
        assert_eq!(MilliCpu(1500).to_string(), "1500m");
        assert_eq!(MilliCpu(2000).to_string(), "2");
    }
}
