"""Checkpoints: `formats/` reads and writes every checkpoint format without process groups (the
conversion tool's side; see its __init__), `io/` is the trainer's side (saving, loading, the
writer lock)."""
