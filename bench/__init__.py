"""Benchmark suite of ppo_fast: ``python -m bench --help``; markdown tables and plots via ``python -m bench report``."""
