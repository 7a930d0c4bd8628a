"""Persistent memory as reusable KV: facts encoded once (pre-RoPE), injected at serving positions."""
