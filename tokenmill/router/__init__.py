"""`tokenmill router`: one OpenAI-compatible endpoint over several replicas, sending each request where
its prompt's prefix is already cached unless that replica is overloaded. Speaks HTTP to any
OpenAI-compatible server; reuses the engine's prompt rendering and block hashing to guess its cache."""
