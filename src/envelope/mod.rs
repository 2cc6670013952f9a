//! Task and result envelopes (design §2).
