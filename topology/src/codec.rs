//! Serde codecs for record keys and values: JSON for external topics, bincode
//! for internal topics and state, plus UTF-8 strings, raw bytes and unit.

use std::marker::PhantomData;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// A codec failed; the reason is short and never contains the payload.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CodecError(pub String);

/// Encodes and decodes one type to Kafka bytes (`None` is a null key/value).
pub trait Codec<T>: Send + Sync + 'static {
    /// Encodes a value.
    fn encode(&self, value: &T) -> Result<Option<Vec<u8>>, CodecError>;
    /// Decodes bytes, `None` being a null key or value.
    fn decode(&self, bytes: Option<&[u8]>) -> Result<T, CodecError>;
}

fn require(bytes: Option<&[u8]>) -> Result<&[u8], CodecError> {
    bytes.ok_or_else(|| CodecError("null bytes".into()))
}

/// JSON via serde_json.
pub struct JsonCodec<T>(PhantomData<fn() -> T>);

impl<T> Default for JsonCodec<T> {
    fn default() -> Self {
        JsonCodec(PhantomData)
    }
}

impl<T: Serialize + DeserializeOwned + 'static> Codec<T> for JsonCodec<T> {
    fn encode(&self, value: &T) -> Result<Option<Vec<u8>>, CodecError> {
        serde_json::to_vec(value)
            .map(Some)
            .map_err(|e| CodecError(format!("json encode: {e}")))
    }
    fn decode(&self, bytes: Option<&[u8]>) -> Result<T, CodecError> {
        serde_json::from_slice(require(bytes)?)
            .map_err(|e| CodecError(format!("malformed json: {}", e.classify_str())))
    }
}

trait ClassifyStr {
    fn classify_str(&self) -> String;
}

impl ClassifyStr for serde_json::Error {
    /// The error category and position only: serde messages may quote input.
    fn classify_str(&self) -> String {
        let kind = match self.classify() {
            serde_json::error::Category::Io => "io",
            serde_json::error::Category::Syntax => "syntax",
            serde_json::error::Category::Data => "data",
            serde_json::error::Category::Eof => "eof",
        };
        format!(
            "{kind} error at line {} column {}",
            self.line(),
            self.column()
        )
    }
}

/// bincode (standard configuration) via serde.
pub struct BincodeCodec<T>(PhantomData<fn() -> T>);

impl<T> Default for BincodeCodec<T> {
    fn default() -> Self {
        BincodeCodec(PhantomData)
    }
}

/// Encodes a value with the bincode configuration used for state and internal topics.
pub fn to_bincode<T: Serialize>(value: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, bincode::config::standard())
        .expect("bincode encoding of an in-memory value does not fail")
}

/// Calls `f` with the bincode bytes of `value`, encoded on the stack when
/// they are short (store keys, on every read and write of a record).
pub(crate) fn with_bincode<T: Serialize, R>(value: &T, f: impl FnOnce(&[u8]) -> R) -> R {
    let mut buf = [0u8; 128];
    match bincode::serde::encode_into_slice(value, &mut buf, bincode::config::standard()) {
        Ok(n) => f(&buf[..n]),
        Err(_) => f(&to_bincode(value)),
    }
}

/// Decodes bytes written by [`to_bincode`].
pub fn from_bincode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    bincode::serde::decode_from_slice(bytes, bincode::config::standard())
        .map(|(v, _)| v)
        .map_err(|e| CodecError(format!("bincode decode: {e}")))
}

impl<T: Serialize + DeserializeOwned + 'static> Codec<T> for BincodeCodec<T> {
    fn encode(&self, value: &T) -> Result<Option<Vec<u8>>, CodecError> {
        Ok(Some(to_bincode(value)))
    }
    fn decode(&self, bytes: Option<&[u8]>) -> Result<T, CodecError> {
        from_bincode(require(bytes)?)
    }
}

/// UTF-8 strings.
#[derive(Default)]
pub struct StringCodec;

impl Codec<String> for StringCodec {
    fn encode(&self, value: &String) -> Result<Option<Vec<u8>>, CodecError> {
        Ok(Some(value.as_bytes().to_vec()))
    }
    fn decode(&self, bytes: Option<&[u8]>) -> Result<String, CodecError> {
        String::from_utf8(require(bytes)?.to_vec()).map_err(|_| CodecError("invalid utf-8".into()))
    }
}

/// Raw bytes, with null allowed.
#[derive(Default)]
pub struct BytesCodec;

impl Codec<Option<Vec<u8>>> for BytesCodec {
    fn encode(&self, value: &Option<Vec<u8>>) -> Result<Option<Vec<u8>>, CodecError> {
        Ok(value.clone())
    }
    fn decode(&self, bytes: Option<&[u8]>) -> Result<Option<Vec<u8>>, CodecError> {
        Ok(bytes.map(<[u8]>::to_vec))
    }
}

/// Ignores the bytes: for keys a topology does not use. Encodes as null.
#[derive(Default)]
pub struct UnitCodec;

impl Codec<()> for UnitCodec {
    fn encode(&self, _: &()) -> Result<Option<Vec<u8>>, CodecError> {
        Ok(None)
    }
    fn decode(&self, _: Option<&[u8]>) -> Result<(), CodecError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_and_errors_do_not_quote_input() {
        let c = JsonCodec::<Vec<u32>>::default();
        let bytes = c.encode(&vec![1, 2]).unwrap();
        assert_eq!(c.decode(bytes.as_deref()).unwrap(), vec![1, 2]);
        let err = c.decode(Some(b"{\"secret prompt\"")).unwrap_err();
        assert!(!err.0.contains("secret"), "{err}");
        assert!(c.decode(None).is_err());
    }

    #[test]
    fn bincode_and_string_round_trip() {
        let b = BincodeCodec::<(String, i64)>::default();
        let v = ("k".to_string(), -3);
        assert_eq!(b.decode(b.encode(&v).unwrap().as_deref()).unwrap(), v);
        assert!(StringCodec.decode(Some(&[0xff, 0xfe])).is_err());
        assert_eq!(BytesCodec.decode(None).unwrap(), None);
    }
}
