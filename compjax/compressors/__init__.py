"""The compressors: one module per family."""
