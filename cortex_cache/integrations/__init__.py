"""Adapters between cortex pools and other systems (each imports its system lazily, if at all)."""
