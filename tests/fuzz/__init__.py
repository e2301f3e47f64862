"""Property and fuzz tests against a real gateway: schemathesis over the served OpenAPI document,
hypothesis-built chat bodies. Bounded (fixed example counts, derandomized) so they run in the
normal suite."""
