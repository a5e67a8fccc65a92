"""The batch engine: see README.md beside this file."""
