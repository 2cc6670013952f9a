//! The LLM provider client and its middleware.
