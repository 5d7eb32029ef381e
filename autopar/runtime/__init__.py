"""Runtime: per-rank job lists, communicators, program segments (stage: runtime)."""
