//! [`ConfigError`]: a configuration problem, shared by the components that
//! check their own sections and by `config.rs`, which composes them.

/// A configuration problem, with the key it concerns.
#[derive(Debug, thiserror::Error)]
#[error("config error at {key}: {message}")]
pub struct ConfigError {
    /// Dotted path of the offending key (or the file).
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}
