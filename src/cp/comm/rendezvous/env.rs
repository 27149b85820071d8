//! A process's place in a multi-process group ([`DistEnv`]) and where rank 0 listens
//! ([`RendezvousAddr`]), parsed from the torchrun environment variables.

use std::ffi::OsString;
use std::fmt;

use crate::error::{GdpError, Result};

const LAUNCH_HINT: &str = "start the processes with `gdp launch --nproc R -- ...` (or torchrun), \
                           which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT";

/// Where rank 0 listens: `MASTER_ADDR:MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousAddr {
    /// Host name or IP address (in practice the loopback address).
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl RendezvousAddr {
    /// `host:port`.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
        }
    }
}

impl fmt::Display for RendezvousAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A process's place in a multi-process group, read from the torchrun environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in the group, `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes in the group.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's index on its machine; the GPU it should use.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`, when set: number of processes on this machine.
    pub local_world_size: Option<usize>,
    /// `MASTER_ADDR:MASTER_PORT`: where rank 0 listens.
    pub master: RendezvousAddr,
}

fn env_err(var: &str, reason: impl Into<String>) -> candle_core::Error {
    GdpError::Env {
        var: var.to_string(),
        reason: reason.into(),
    }
    .into()
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (optional), `MASTER_ADDR`
    /// and `MASTER_PORT` from `vars`, the environment that `gdp launch` (or torchrun) gave the
    /// process: pass `std::env::vars_os()`. The library itself reads no environment variable.
    /// A missing or malformed variable is a [`GdpError::Env`] naming it and the value it had.
    pub fn from_vars(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Result<Self> {
        let vars: std::collections::HashMap<OsString, OsString> = vars.into_iter().collect();
        Self::from_lookup(|k| vars.get(std::ffi::OsStr::new(k)).cloned())
    }

    /// [`DistEnv::from_vars`] with each variable looked up through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Result<Self> {
        let text = |var: &str| -> Result<Option<String>> {
            match get(var) {
                None => Ok(None),
                Some(v) => v
                    .into_string()
                    .map(Some)
                    .map_err(|v| env_err(var, format!("expected UTF-8 text, got {v:?}"))),
            }
        };
        let required = |var: &str| -> Result<String> {
            text(var)?.ok_or_else(|| env_err(var, format!("not set; {LAUNCH_HINT}")))
        };
        let int = |var: &str, s: &str, what: &str| -> Result<usize> {
            s.trim()
                .parse::<usize>()
                .map_err(|_| env_err(var, format!("expected {what}, got `{s}`")))
        };
        let world_size = int("WORLD_SIZE", &required("WORLD_SIZE")?, "a positive integer")?;
        if world_size == 0 {
            return Err(env_err(
                "WORLD_SIZE",
                "expected a positive integer, got `0`",
            ));
        }
        let range = format!("an integer in 0..WORLD_SIZE = 0..{world_size}");
        let rank = int("RANK", &required("RANK")?, &range)?;
        if rank >= world_size {
            return Err(env_err("RANK", format!("expected {range}, got `{rank}`")));
        }
        let local_world_size = match text("LOCAL_WORLD_SIZE")? {
            None => None,
            Some(s) => {
                let n = int("LOCAL_WORLD_SIZE", &s, "a positive integer")?;
                if n == 0 {
                    return Err(env_err(
                        "LOCAL_WORLD_SIZE",
                        "expected a positive integer, got `0`",
                    ));
                }
                Some(n)
            }
        };
        let local_rank = int(
            "LOCAL_RANK",
            &required("LOCAL_RANK")?,
            "a non-negative integer (the GPU index)",
        )?;
        if let Some(n) = local_world_size {
            if local_rank >= n {
                return Err(env_err(
                    "LOCAL_RANK",
                    format!(
                        "expected an integer in 0..LOCAL_WORLD_SIZE = 0..{n}, got `{local_rank}`"
                    ),
                ));
            }
        }
        let host = required("MASTER_ADDR")?.trim().to_string();
        if host.is_empty() {
            return Err(env_err(
                "MASTER_ADDR",
                "expected a host name or IP address, got an empty value",
            ));
        }
        let port_text = required("MASTER_PORT")?;
        let port = port_text
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| {
                env_err(
                    "MASTER_PORT",
                    format!("expected a TCP port in 1..=65535, got `{port_text}`"),
                )
            })?;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master: RendezvousAddr { host, port },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).map(OsString::from)
    }

    const GOOD: [(&str, &str); 6] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "3"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "3"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    fn with(change: (&str, Option<&str>)) -> Vec<(&'static str, String)> {
        GOOD.iter()
            .filter(|(k, _)| *k != change.0)
            .map(|(k, v)| (*k, v.to_string()))
            .chain(change.1.map(|v| {
                let k: &'static str = GOOD.iter().find(|(k, _)| *k == change.0).unwrap().0;
                (k, v.to_string())
            }))
            .collect()
    }

    fn env_error(change: (&str, Option<&str>)) -> String {
        let vars = with(change);
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        DistEnv::from_lookup(lookup(&pairs))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn dist_env_parses_and_names_bad_variables() {
        let env = DistEnv::from_lookup(lookup(&GOOD)).unwrap();
        assert_eq!(
            env,
            DistEnv {
                rank: 1,
                world_size: 3,
                local_rank: 1,
                local_world_size: Some(3),
                master: RendezvousAddr::new("127.0.0.1", 29500),
            }
        );
        for (change, needles) in [
            (("RANK", None), vec!["`RANK`", "not set", "gdp launch"]),
            (("RANK", Some("x1")), vec!["`RANK`", "0..3", "`x1`"]),
            (("RANK", Some("3")), vec!["`RANK`", "0..3", "`3`"]),
            (
                ("WORLD_SIZE", Some("0")),
                vec!["`WORLD_SIZE`", "positive", "`0`"],
            ),
            (("WORLD_SIZE", Some("-2")), vec!["`WORLD_SIZE`", "`-2`"]),
            (("LOCAL_RANK", None), vec!["`LOCAL_RANK`", "not set"]),
            (
                ("LOCAL_RANK", Some("5")),
                vec!["`LOCAL_RANK`", "0..3", "`5`"],
            ),
            (("MASTER_ADDR", Some(" ")), vec!["`MASTER_ADDR`", "empty"]),
            (
                ("MASTER_PORT", Some("0")),
                vec!["`MASTER_PORT`", "1..=65535", "`0`"],
            ),
            (
                ("MASTER_PORT", Some("70000")),
                vec!["`MASTER_PORT`", "`70000`"],
            ),
            (("MASTER_PORT", None), vec!["`MASTER_PORT`", "not set"]),
        ] {
            let e = env_error(change);
            assert!(e.starts_with("environment variable"), "{e}");
            for n in needles {
                assert!(e.contains(n), "{change:?}: `{n}` not in: {e}");
            }
        }
        // LOCAL_WORLD_SIZE is optional.
        let vars = with(("LOCAL_WORLD_SIZE", None));
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            DistEnv::from_lookup(lookup(&pairs))
                .unwrap()
                .local_world_size,
            None
        );
    }

    #[test]
    fn display_addr() {
        assert_eq!(
            RendezvousAddr::new("127.0.0.1", 5).to_string(),
            "127.0.0.1:5"
        );
        assert_eq!(RendezvousAddr::new("::1", 5).to_string(), "[::1]:5");
    }
}
