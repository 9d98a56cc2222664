"""Investigations whose results a design choice rests on (docs/benchmarks.md, "Measurements
behind the design"), kept to be run again when that choice is questioned."""
