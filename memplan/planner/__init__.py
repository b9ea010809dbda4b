"""Decisions: the fit test (budget), the fit table (fit_table), the best-first plan search (search, candidates,
explain, types), the allocator-checked micro-batch (refine), plan files and launcher configs (export), and the
doctor's remedies (doctor, remedies, oom). Imports the estimator, the replay and below; never the CLI.
"""
