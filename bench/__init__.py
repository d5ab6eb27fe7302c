"""Benchmark suite of ppo_fast: ``python -m bench --help``; README tables via ``python -m bench report``."""
