//! The simulated OpenAI-compatible provider.
