"""The client of an SGLang server's native API and its request payloads."""
