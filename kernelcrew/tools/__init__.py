"""Deterministic tools the agents call: sandbox, build, verification, timing, hardware. No LLM in here."""
