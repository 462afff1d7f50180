"""Benchmarks behind `tensortier bench ...`: one module per area, peers side by side, JSON out."""
