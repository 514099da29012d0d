"""A training run: its directory and what makes it trustworthy (stage records, lock, resume), the live
session, the stages of an iteration, the loop around them, and what the run logs to MLflow.

Import names from the module that defines them; this package re-exports nothing.
"""
